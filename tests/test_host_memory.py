"""The host allocator of a worker on a CPU device (hetero.runtime.host_memory): what it frees stays
mapped for its next tensors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetero.runtime.host_memory import KEEP_ENV

PROBE = r"""
import json, sys, torch
from hetero.runtime.host_memory import keep_freed_host_memory, mapped_free_bytes
kept = keep_freed_host_memory()
block = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)   # one 256 MB tensor, written, then freed
del block
print(json.dumps({"kept": kept, "free": mapped_free_bytes()}))
"""


def _probe(keep: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, KEEP_ENV: keep})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_freed_tensor_stays_mapped_only_where_the_worker_keeps_freed_memory():
    kept, default = _probe("1"), _probe("0")
    if not kept["kept"]:
        pytest.skip("this C library has no mallopt (not glibc)")
    assert kept["free"] >= 256 << 20            # reused by the next tensors without a page fault
    assert not default["kept"]
    assert default["free"] < 64 << 20           # glibc's default: the block went back to the kernel


RESERVE = r"""
import json, types, torch
from hetero.runtime.host_memory import mapped_free_bytes
from hetero.runtime.reshard.live import reserve_key
from hetero.runtime.reshard.resume import LiveReconfig

class Store(dict):   # the coordinator's store, as reserve_ahead reads it
    def check(self, keys):
        return all(k in self for k in keys)

live = LiveReconfig.__new__(LiveReconfig)
live.store, live.gen, live.rank = Store(), 0, 1
trainer = types.SimpleNamespace(ctx=types.SimpleNamespace(device=torch.device("cpu")))
live.reserve_ahead(trainer)   # nothing published yet: nothing made
before = mapped_free_bytes()
live.store[reserve_key(0)] = json.dumps({"0": 1 << 20, "1": 300 << 20})
live.reserve_ahead(trainer)
print(json.dumps({"before": before, "after": mapped_free_bytes(), "reserved": live.reserved}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_rank_keeps_mapped_what_its_exchange_would_allocate_after_a_loss():
    out = subprocess.run([sys.executable, "-c", RESERVE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, KEEP_ENV: "1"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reserved"] == 0
    assert got["before"] < 300 << 20 <= got["after"]   # rank 1's figure, not rank 0's
