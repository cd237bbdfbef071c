"""The elastic benchmark's launcher memory counts the node launchers too, not their workers."""
from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(60)

# a top process that starts a "node launcher" (its argv names the node launcher's module) holding
# 200 MB, which starts a "worker" holding 300 MB; the top process itself holds little
_WORKER = "b = bytearray(300 * 2**20); import time; time.sleep(1.5)"
_NODE = ("import subprocess, sys, time; b = bytearray(200 * 2**20); "
         f"w = subprocess.Popen([sys.executable, '-c', {_WORKER!r}]); time.sleep(1.5); w.wait()")
_TOP = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_NODE!r}, 'hetero.runtime.torchrun_loopback'])"


def test_launcher_peak_is_the_launch_process_and_its_node_launchers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_elastic

    done, launcher, top = bench_elastic._peak_rss_launch([sys.executable, "-c", _TOP])
    assert done.returncode == 0, done.stderr
    assert top < 100, top                          # the top process alone: a bare interpreter
    assert 200 + top <= launcher < 300 + top, (launcher, top)   # plus the node launcher, not its worker
