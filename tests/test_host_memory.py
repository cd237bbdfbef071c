"""The host allocator of a worker on a CPU device (hetero.runtime.host_memory): what it frees stays
mapped for its next tensors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import live_run
from hetero.runtime.host_memory import HUGE_PAGES_ENV, KEEP_ENV, huge_pages_env

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
import json, sys
sys.path.insert(0, sys.argv[1])   # tests/, for helpers
from helpers import DictStore
from hetero.runtime.host_memory import mapped_free_bytes
from hetero.runtime.reshard.live import reserve_key
from hetero.runtime.elastic.reconfig import LiveReconfig

live = LiveReconfig.__new__(LiveReconfig)
live.store, live.gen, live.rank = DictStore(), 0, 1
live.reserve_ahead()   # nothing published yet: nothing made
before = mapped_free_bytes()
live.store[reserve_key(0)] = json.dumps({"0": 1 << 20, "1": 300 << 20})
live.reserve_ahead()
print(json.dumps({"before": before, "after": mapped_free_bytes(), "reserved": live.reserved}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_rank_keeps_mapped_what_its_exchange_would_allocate_after_a_loss():
    out = subprocess.run([sys.executable, "-c", RESERVE, os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=120,
                         env={**os.environ, KEEP_ENV: "1"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reserved"] == 0
    assert got["before"] < 300 << 20 <= got["after"]   # rank 1's figure, not rank 0's


@pytest.mark.parametrize("plan,reserved", [("tiny-local-cpu-replicated.yaml", True), ("tiny-local-cpu-pp.yaml", False)],
                         ids=["every layer replicated", "no replica"])
def test_the_launcher_reserves_for_the_losses_an_exchange_would_serve(tmp_path, plan, reserved):
    """Planned ahead for every single loss, the launcher tells each rank the most state its exchange
    would allocate: a share of the model where every layer has a copy elsewhere; nothing where each
    loss leaves layers without a copy (that run goes on from a checkpoint, or ends)."""
    from hetero.runtime.reshard.live import reserve_key
    from hetero.runtime.reshard.space import ParameterSpace

    run, _, model, _, launch = live_run(tmp_path, plan)
    try:
        run._plan_ahead()   # what start() runs beside the workers
        got = json.loads(run.coordinator.store.get(reserve_key(0)))
    finally:
        run.coordinator.close()
    if not reserved:
        assert got == {}
        return
    whole = ParameterSpace(model).total_bytes()
    members = {str(r) for ahead in run._ahead.values() for r in ahead.members}   # ranks some new plan keeps
    assert len(run._ahead) == launch.layout.world_size and set(got) == members and members
    assert all(0 < b < whole for b in got.values()), (got, whole)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED): Linux")
def test_the_pages_outside_a_kept_view_go_back_to_the_kernel():
    """A tp half kept as a view of the old whole tensor (the exchange's copy-free keep): once the old
    tensor is dropped, the pages only the other half used are given back; the view's values stay."""
    import torch

    from hetero.runtime.host_memory import release_unused_pages

    page = os.sysconf("SC_PAGE_SIZE")
    whole = torch.arange(1 << 20, dtype=torch.float32)   # 4 MB, several hundred pages
    for keep_second in (False, True):
        w = whole.clone()
        half = w[(1 << 19):] if keep_second else w[:1 << 19]
        want = half.clone()
        released = release_unused_pages([half])
        assert torch.equal(half, want)
        other = w[:1 << 19] if keep_second else w[(1 << 19):]
        # whole pages of the other half only: at most one partial page at each end is kept
        assert other.nbytes - 2 * page <= released <= other.nbytes
        dropped = (other == 0).sum().item()   # a dropped page reads as zeros when touched again
        assert dropped * 4 >= released
    assert release_unused_pages([whole]) == 0   # a tensor using its whole storage: nothing to give back
    # two tensors of one storage (a flat vector): only the pages neither uses go
    flat = torch.arange(1 << 20, dtype=torch.float32)
    a, b = flat[:1 << 18], flat[3 << 18:]
    wa, wb = a.clone(), b.clone()
    released = release_unused_pages([b, a])
    assert torch.equal(a, wa) and torch.equal(b, wb)
    assert (2 << 18) * 4 - 2 * page <= released <= (2 << 18) * 4


HUGE = r"""
import json, sys, torch
from hetero.runtime.host_memory import keep_freed_host_memory
keep_freed_host_memory()   # as a CPU-device worker: the heap serves large blocks too
tensors = [torch.empty(64 << 20, dtype=torch.uint8).fill_(1) for _ in range(2)]   # a stage's state
huge = 0
for t in tensors:
    ptr = t.data_ptr()
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:   # a mapping's address range starts its block
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1]) << 10
print(json.dumps({"huge": huge}))
"""


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _huge_bytes(env: dict) -> int:
    clean = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, timeout=120,
                         env={**clean, **env, KEEP_ENV: "1"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["huge"]


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="this kernel gives no transparent huge pages "
                    "(/sys/kernel/mm/transparent_hugepage/enabled missing or [never])")
def test_a_cpu_device_workers_environment_maps_its_large_tensors_in_huge_pages():
    """What the launcher adds to a CPU-device worker's environment makes torch's allocator map a
    stage's large tensors in 2 MB pages, the heap kept as the worker keeps it (what a same-host
    exchange reads faster, docs/elastic.md); a user's own setting wins."""
    env = huge_pages_env({})
    assert env == {HUGE_PAGES_ENV: "1"}
    assert huge_pages_env({HUGE_PAGES_ENV: "0"}) == {}
    assert _huge_bytes(env) >= 64 << 20   # at least half of the two 64 MB tensors in huge pages
    if _thp_mode() == "madvise":          # only asked-for memory gets them: off without the variable
        assert _huge_bytes({HUGE_PAGES_ENV: "0"}) == 0
