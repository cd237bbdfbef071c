"""hetero memplan: allocation traces, the caching allocator's replay, the planned arena, the CLI."""
from __future__ import annotations

import json
import math
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.memplan import AllocationTrace, memory_plan, plan_arena, simulate_caching_allocator
from hetero.memplan.caching import CachingAllocatorModel, round_size, segment_size

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _trace(*events):
    return AllocationTrace([(k, key, size) for k, key, size in events])


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "hetero", "memplan", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


# ------------------------------------------------------------------ the trace


def test_lower_bound_and_lifetimes_of_a_trace():
    t = _trace(("alloc", 1, 100), ("alloc", 2, 50), ("free", 1, 100), ("alloc", 3, 120), ("free", 9, 30))
    # block 9 was allocated before the trace: live from the start, freed at event 4
    assert t.lower_bound_bytes() == 30 + 50 + 120
    blocks = sorted((b.size, b.start, b.end) for b in t.blocks())
    assert blocks == [(30, -1, 4), (50, 1, 5), (100, 0, 2), (120, 3, 5)]


def test_an_id_reused_without_its_free_ends_the_old_block():
    t = _trace(("alloc", 7, 100), ("alloc", 7, 40))
    assert t.lower_bound_bytes() == 100
    assert sorted((b.size, b.start, b.end) for b in t.blocks()) == [(40, 1, 2), (100, 0, 1)]


# ------------------------------------------------------------------ the caching allocator's policy


def test_request_rounding_and_segment_sizes_follow_the_cuda_caching_allocator():
    assert [round_size(s) for s in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(1) == segment_size(MiB) == 2 * MiB          # small pool: 2 MiB segments
    assert segment_size(MiB + 1) == segment_size(10 * MiB - 1) == 20 * MiB
    assert segment_size(12_000_000) == 6 * 2 * MiB                  # rounded up to 2 MiB


def test_small_requests_share_a_2_mib_segment_until_it_is_full():
    m = CachingAllocatorModel()
    for _ in range(4096):       # 4096 x 512 B = one 2 MiB segment
        m.malloc(100)
    assert (m.segments, m.reserved) == (1, 2 * MiB)
    m.malloc(100)
    assert (m.segments, m.reserved) == (2, 4 * MiB)


def test_freed_neighbours_merge_and_serve_a_larger_request():
    m = CachingAllocatorModel()
    a, b = m.malloc(5 * MiB), m.malloc(5 * MiB)     # two blocks of one 20 MiB segment
    assert (m.segments, m.reserved) == (1, 20 * MiB)
    m.free(a)
    m.free(b)
    m.malloc(19 * MiB)                               # fits only in the merged 20 MiB block
    assert (m.segments, m.reserved) == (1, 20 * MiB)


def test_without_merging_a_larger_request_needs_a_new_segment():
    m = CachingAllocatorModel()
    a, _keep, _rest = m.malloc(5 * MiB), m.malloc(5 * MiB), m.malloc(9 * MiB)
    m.free(a)                                        # a 5 MiB hole beside a live block
    m.malloc(6 * MiB)
    assert m.segments == 2 and m.reserved == 40 * MiB


def test_the_pools_do_not_lend_to_each_other():
    m = CachingAllocatorModel()
    small = [m.malloc(MiB) for _ in range(2)]        # the small pool's 2 MiB segment, full
    for addr in small:
        m.free(addr)
    m.malloc(MiB + 512)                              # a large request: 2 MiB free in the small pool do not serve it
    assert m.segments == 2 and m.reserved == 22 * MiB


def test_a_large_block_keeps_a_rest_of_at_most_1_mib_unsplit():
    m = CachingAllocatorModel()
    m.malloc(int(19.5 * MiB))                        # 20 MiB segment; rest 0.5 MiB stays inside the block
    assert m.allocated == 20 * MiB
    m.malloc(int(0.25 * MiB))                        # a small request: a new small segment
    assert m.segments == 2


MIXES = {   # request sizes of the random traces the allocator was measured on (tests/data/cuda_allocator_h100.json)
    "mixed": lambda r: r.choice([r.randint(1, 4096), r.randint(1, 3 * MiB), r.randint(MiB, 40 * MiB)]),
    "small": lambda r: r.choice([r.randint(1, 4096), r.randint(1, MiB)]),
    "activations": lambda r: r.choice([r.randint(1, 64) * 512 * 1024, r.randint(1, 8) * 4 * MiB, r.randint(1, 4096)]),
}
MEASURED = json.loads((Path(__file__).parent / "data" / "cuda_allocator_h100.json").read_text())


def _measured_trace(mix: str, seed: int, n: int = 3000, alloc=None) -> AllocationTrace:
    """``n`` events: 45% frees of a random live block, else a request drawn from ``mix``; ``alloc(size)``
    (a real allocation, kept live until its free) is called for each request when given."""
    rng, draw = random.Random(seed), MIXES[mix]
    live, events = {}, []
    for i in range(n):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            del live[key]
            events.append(("free", key, 0))
        else:
            size = draw(rng)
            live[i] = alloc(size) if alloc else None
            events.append(("alloc", i, size))
    return AllocationTrace(events)


@pytest.mark.parametrize("case", MEASURED["traces"], ids=lambda c: f"{c['mix']}-{c['seed']}")
def test_the_replay_with_the_drivers_segment_addresses_reserves_what_the_allocator_reserved(case):
    """Measured on an H100: with each segment where the driver put it, the replay is exact."""
    trace = _measured_trace(case["mix"], case["seed"], MEASURED["events_per_trace"])
    trace.segment_addresses = case["segment_addresses"]
    result = simulate_caching_allocator(trace)
    assert (result.reserved_bytes, result.segments) == (case["reserved_bytes"], len(case["segment_addresses"]))


def test_without_addresses_new_segments_go_below_the_old_as_the_driver_mostly_put_them():
    """Which of equal free blocks is the lowest decides later merges; without the addresses the
    replay places each new segment lowest. Against the 12 measured traces: exact on 8, within 4 MiB."""
    errors = [simulate_caching_allocator(_measured_trace(c["mix"], c["seed"])).reserved_bytes - c["reserved_bytes"]
              for c in MEASURED["traces"]]
    assert sum(e == 0 for e in errors) >= 8 and max(map(abs, errors)) <= 4 * MiB, errors


@pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                    reason="needs a CUDA GPU: the replay is compared with torch.cuda.memory_reserved()")
def test_the_replay_reserves_what_the_cuda_caching_allocator_reserves():
    import torch

    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    known = {s["address"] for s in torch.cuda.memory_snapshot()}
    segments, last = [], [base]

    def alloc(size):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        if torch.cuda.memory_reserved() != last[0]:   # a new segment: where the driver put it
            last[0] = torch.cuda.memory_reserved()
            for s in torch.cuda.memory_snapshot():
                if s["address"] not in known:
                    known.add(s["address"])
                    segments.append(s["address"])
        return t

    trace = _measured_trace("mixed", 0, alloc=alloc)
    reserved = torch.cuda.memory_reserved() - base
    torch.cuda.empty_cache()
    trace.segment_addresses = segments
    assert simulate_caching_allocator(trace).reserved_bytes == reserved


# ------------------------------------------------------------------ the planned arena


def _random_trace(n, seed):
    rng = random.Random(seed)
    live, events = [], []
    for i in range(n):
        if live and rng.random() < 0.5:
            key = live.pop(rng.randrange(len(live)))
            events.append(("free", key, 0))
        else:
            events.append(("alloc", i, rng.choice([rng.randint(1, 2048), rng.randint(1, 10 * MiB)])))
            live.append(i)
    return AllocationTrace(events)


@pytest.mark.parametrize("seed", range(4))
def test_the_planned_arena_never_overlaps_live_blocks_and_beats_the_caching_allocator(seed):
    trace = _random_trace(1500, seed)
    plan = plan_arena(trace)
    assert plan.overlaps() == []
    lower = trace.lower_bound_bytes()
    assert lower <= plan.arena_bytes < simulate_caching_allocator(trace).reserved_bytes
    # random frees are the heuristic's hard case: 1.00-1.13x the lower bound over 8 seeds (the
    # caching allocator 1.16-1.45x); a training step's trace comes within 1% (test below)
    assert plan.arena_bytes <= 1.15 * lower, (plan.arena_bytes, lower)


def test_blocks_live_at_different_times_share_their_bytes():
    # a: [0,2), b: [2,4), c: [1,3): a and b never live together, so they take the same offset
    t = _trace(("alloc", "a", 4096), ("alloc", "c", 1024), ("free", "a", 0), ("alloc", "b", 4096),
               ("free", "c", 0), ("free", "b", 0))
    plan = plan_arena(t)
    assert plan.arena_bytes == 4096 + 1024 == t.lower_bound_bytes()


def test_blocks_allocated_before_the_trace_are_left_to_the_caching_allocator():
    t = _trace(("free", "old", 3000), ("alloc", "x", 1024), ("free", "x", 0))
    plan = plan_arena(t)
    assert plan.dynamic_fallback_bytes == 3000 and plan.arena_bytes == 1024
    report = memory_plan(t)
    assert report["planned"]["dynamic_fallback_bytes"] == 3000
    # the old block is freed before x is allocated: 3000 bytes live at most; the plan holds its arena
    # beside what the caching allocator keeps for the old block
    assert report["lower_bound_bytes"] == 3000
    assert report["planned"]["fragmentation"] == pytest.approx(1 - 3000 / 4024)


def test_the_report_follows_the_schema_and_its_formulas():
    report = memory_plan(_random_trace(800, 7))
    assert set(report) == {"events", "lower_bound_bytes", "caching_allocator", "planned", "fragmentation_reduction"}
    lb, c, p = report["lower_bound_bytes"], report["caching_allocator"], report["planned"]
    assert set(c) == {"reserved_bytes", "fragmentation"}
    assert set(p) == {"arena_bytes", "fragmentation", "dynamic_fallback_bytes"}
    assert c["fragmentation"] == pytest.approx(1 - lb / c["reserved_bytes"])
    assert p["fragmentation"] == pytest.approx(1 - lb / p["arena_bytes"])
    assert report["fragmentation_reduction"] == pytest.approx(1 - p["fragmentation"] / c["fragmentation"])
    assert report["events"] == 800


# ------------------------------------------------------------------ snapshots


def _snapshot(path, events):
    data = {"segments": [], "device_traces": [[], [dict(e, stream=0, frames=[]) for e in events]]}
    path.write_bytes(pickle.dumps(data))


def test_a_cuda_snapshot_is_read_as_its_alloc_and_free_completed_events(tmp_path):
    from hetero.memplan import load_snapshot

    _snapshot(tmp_path / "s.pickle", [
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB},
        {"action": "alloc", "addr": 0, "size": 512}, {"action": "alloc", "addr": 512, "size": 1024},
        {"action": "free_requested", "addr": 0, "size": 512}, {"action": "free_completed", "addr": 0, "size": 512},
        {"action": "alloc", "addr": 0, "size": 512}, {"action": "segment_alloc", "addr": 6 * MiB, "size": 2 * MiB}])
    trace = load_snapshot(tmp_path / "s.pickle")
    assert trace.events == [("alloc", 0, 512), ("alloc", 512, 1024), ("free", 0, 512), ("alloc", 0, 512)]
    assert trace.segment_addresses == [0, 6 * MiB]   # where the driver put them: the replay's tie-breaks
    assert trace.lower_bound_bytes() == 1536
    proc = _cli("--trace", str(tmp_path / "s.pickle"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["lower_bound_bytes"] == 1536


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_snapshot_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 0, "size": 1,
                                                      "x": _RunsCode(str(marker))}]]}))
    proc = _cli("--trace", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "not a memory snapshot" in proc.stderr and "pathlib" in proc.stderr, proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("content, message", [(b"not a pickle", "not a memory snapshot"),
                                              (pickle.dumps({"segments": []}), "no allocation events"),
                                              (pickle.dumps([1, 2]), "no allocation events")])
def test_a_file_that_is_no_snapshot_is_an_error_naming_it(tmp_path, content, message):
    f = tmp_path / "x.pickle"
    f.write_bytes(content)
    proc = _cli("--trace", str(f))
    assert proc.returncode == 1 and message in proc.stderr and "x.pickle" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ recording a stage


def _tiny_plan(**over):
    plan = {"global_batch_size": 4, "micro_batch_size": 1, "schedule": "1f1b",
            "pipelines": [{"replicas": 1, "micro_batches": 4,
                           "stages": [{"group": "fast", "layers": [0, 2]}, {"group": "slow", "layers": [2, 4]}]}]}
    plan.update(over)
    return plan


TINY = {"name": "t", "architecture": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "vocab_size": 256, "seq_length": 32, "dtype": "fp32"}


def test_the_fake_recording_matches_the_same_steps_run_for_real():
    """The trace recorded on fake tensors has the bytes a real CPU run of the same stage allocates."""
    torch = pytest.importorskip("torch")
    import hetero
    from hetero.memplan import record

    model, plan = hetero.load_model(TINY), hetero.load_plan(_tiny_plan())
    for stage in (0, 1):
        fake = record.record_stage(model, plan, 0, stage)
        real = record.record_stage(model, plan, 0, stage, fake=False)
        assert len(fake.events) > 100
        assert fake.lower_bound_bytes() == real.lower_bound_bytes(), stage
        assert sorted(s for k, _, s in fake.events if k == "alloc") == sorted(s for k, _, s in real.events if k == "alloc")
    del torch


def test_the_last_stage_holds_the_head_and_1f1b_keeps_fewer_activations_there():
    import hetero
    from hetero.memplan.record import record_stage

    model, plan = hetero.load_model(TINY), hetero.load_plan(_tiny_plan())
    first, last = record_stage(model, plan, 0, 0), record_stage(model, plan, 0, 1)
    # 1F1B: stage 0 of 2 keeps two micro-batches' activations in flight, the last stage one
    assert first.lower_bound_bytes() > last.lower_bound_bytes()
    gpipe = record_stage(model, hetero.load_plan(_tiny_plan(schedule="gpipe")), 0, 1)
    assert gpipe.lower_bound_bytes() > last.lower_bound_bytes()   # GPipe keeps all four


def test_tp_shards_and_zero_moments_shrink_the_recorded_stage():
    import hetero
    from hetero.memplan.record import record_stage
    from hetero.runtime.model import stage_param_shapes

    model = hetero.load_model(TINY)
    one = record_stage(model, hetero.load_plan(_tiny_plan()), 0, 0)
    tp2 = record_stage(model, hetero.load_plan(_tiny_plan(pipelines=[{
        "replicas": 1, "micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 2], "tp": 2},
                                                      {"group": "slow", "layers": [2, 4]}]}])), 0, 0)
    assert tp2.lower_bound_bytes() < 0.75 * one.lower_bound_bytes()
    two = _tiny_plan(global_batch_size=8, pipelines=[{**_tiny_plan()["pipelines"][0], "replicas": 2}])
    plain = record_stage(model, hetero.load_plan(two), 0, 0)
    zero = record_stage(model, hetero.load_plan({**two, "zero_stage": 1}), 0, 0)
    assert zero.lower_bound_bytes() < plain.lower_bound_bytes()

    def kept(trace):   # what lives past the steps: parameters, AdamW's moments and step counters
        return sum(b.size for b in trace.blocks() if b.end == len(trace.events))

    # two replicas: each keeps half of AdamW's two fp32 moments, 4 of their 8 bytes per parameter
    params = sum(math.prod(s) for s in stage_param_shapes(model, (0, 2), True, False).values())
    assert kept(plain) - kept(zero) == pytest.approx(4 * params, rel=0.01), (kept(plain) - kept(zero), 4 * params)


def test_an_interleaved_stage_runs_its_chunks():
    import hetero
    from hetero.memplan.record import record_stage, stage_of

    plan = hetero.load_plan(ROOT / "configs/plans/tiny-local-cpu-interleaved.yaml")
    model = hetero.load_model(ROOT / "configs/models/tiny.yaml")
    where = stage_of(plan, 0, 0)
    assert len(where["chunks"]) == plan.interleave and where["first"]
    assert record_stage(model, plan, 0, 0).lower_bound_bytes() > 0


# ------------------------------------------------------------------ the command


def test_memplan_json_on_a_shipped_plan():
    proc = _cli("--model", "configs/models/tiny.yaml", "--plan", "configs/plans/tiny-local-cpu-pp.yaml",
                "--stage", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["events"] > 0 and report["planned"]["arena_bytes"] >= report["lower_bound_bytes"] > 0
    assert report["caching_allocator"]["reserved_bytes"] >= report["planned"]["arena_bytes"]


def test_memplan_prints_a_table():
    proc = _cli("--model", "configs/models/tiny.yaml", "--plan", "configs/plans/local-cpu-tiny.yaml")
    assert proc.returncode == 0, proc.stderr
    for row in ("lower bound", "caching allocator", "planned arena", "fragmentation reduction"):
        assert row in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, code, message", [
    (["--plan", "configs/plans/local-cpu-tiny.yaml"], 2, "--model and --plan are needed"),
    (["--model", "configs/models/tiny.yaml", "--plan", "configs/plans/local-cpu-tiny.yaml", "--stage", "3"], 1,
     "--stage 3: pipeline 0 of the plan has stages 0-0"),
    (["--model", "configs/models/tiny.yaml", "--plan", "configs/plans/local-cpu-tiny.yaml", "--pipeline", "2"], 1,
     "--pipeline 2: the plan has pipelines 0-0"),
    (["--model", "configs/models/llama2-7b.yaml", "--plan", "configs/plans/local-cpu-tiny.yaml"], 1,
     "pipelines[0].stages[0].layers"),
])
def test_memplan_errors_name_the_option_or_field(args, code, message):
    _check_cli_error(args, code, message)


@pytest.mark.parametrize("args, code, message", [
    (["--trace", "{tmp}"], 1, "not a file"),
    (["--trace", "{snap}", "--stage", "1"], 2, "--stage would record a stage instead"),
    (["--trace", "{snap}", "--device", "5"], 1, "no device 5; the snapshot has devices 0-1"),
    (["--trace", "{huge}"], 1, "integers in [0, 2**63)"),
    (["--model", "configs/models/tiny.yaml", "--plan", "configs/plans/local-cpu-tiny.yaml", "--device", "0"], 2,
     "--device picks a device of a --trace snapshot"),
])
def test_memplan_snapshot_errors(tmp_path, args, code, message):
    _snapshot(tmp_path / "s.pickle", [{"action": "alloc", "addr": 0, "size": 512}])
    _snapshot(tmp_path / "huge.pickle", [{"action": "alloc", "addr": 0, "size": 2**80}])
    args = [a.format(tmp=tmp_path, snap=tmp_path / "s.pickle", huge=tmp_path / "huge.pickle") for a in args]
    _check_cli_error(args, code, message)


def _check_cli_error(args, code, message):
    proc = _cli(*args)
    assert proc.returncode == code and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ the predictor against recorded stages


def _sized(name, layers, **over):
    import hetero

    d = hetero.load_model(ROOT / f"configs/models/{name}.yaml").to_dict()
    # the runtime runs SDPA: the predictor's "fused" attention is what it keeps
    d.update(num_layers=layers, attention="fused", **over)
    return hetero.load_model(d)


def _even(L, stages, tp=1, m=4, replicas=1, **over):
    cuts = [round(i * L / stages) for i in range(stages + 1)]
    plan = {"global_batch_size": m * replicas, "micro_batch_size": 1, "schedule": "1f1b",
            "pipelines": [{"replicas": replicas, "micro_batches": m,
                           "stages": [{"group": "a100", "layers": [cuts[i], cuts[i + 1]], "tp": tp}
                                      for i in range(stages)]}]}
    plan.update(over)
    return plan


RECORDED_CASES = {
    "gpt2-large bf16": ("gpt2-large", 4, {"dtype": "bf16"}, _even(4, 2)),
    "gpt2-large fp32": ("gpt2-large", 4, {}, _even(4, 2)),
    "llama2-7b bf16 tp2": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, tp=2)),
    "llama2-7b bf16 zero1 x2": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, replicas=2, zero_stage=1)),
    "llama2-7b bf16 full": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, recompute="full")),
    # gradient sums dominate: the summed buffer after the activations are freed
    "llama2-7b full x2 seq512": ("llama2-7b", 4, {"seq_length": 512}, _even(4, 2, replicas=2, recompute="full")),
    "llama2-7b zero1 x2 seq512": ("llama2-7b", 4, {"seq_length": 512}, _even(4, 2, replicas=2, zero_stage=1)),
    "gpt3-1.3b fp16 gpipe": ("gpt3-1.3b", 4, {}, _even(4, 2, schedule="gpipe")),
    # three physical stages (over two of one NCCL vendor interleaving is refused: tagless send/recv);
    # four micro-batches fit in the first device's warm-up: every forward before its first backward
    "gpt3-1.3b bf16 interleaved": ("gpt3-1.3b", 6, {"dtype": "bf16"},
                                   {**_even(6, 6), "schedule": "interleaved", "interleave": 2}),
}


@pytest.mark.parametrize("case", sorted(RECORDED_CASES))
def test_predicted_stage_memory_is_within_10_percent_of_the_recorded_runtime_stage(case):
    """hetero predict's stage memory (less the fixed framework overhead, which no tensor holds)
    against the lower bound of the same stage's recorded allocations: real model widths, mixed
    precision, tp, ZeRO, recomputation and interleaving, which the CPU-sized fp32 validation in
    test_memory_validation.py does not reach. Measured: -4.9% .. +2.3% over these 19 stages (the
    interleaved case's first device: +12.8% before its warm-up was charged without gradients)."""
    import hetero
    from hetero.memplan.record import record_stage
    from hetero.predictor.memory import FRAMEWORK_OVERHEAD

    name, layers, over, plan = RECORDED_CASES[case]
    model, plan = _sized(name, layers, **over), hetero.load_plan(plan)
    cluster = hetero.load_cluster(ROOT / "configs/clusters/a100-homogeneous.yaml")
    pred = hetero.predict(cluster, model, plan)
    for stage in range(len(plan.physical_stages(plan.pipelines[0]))):
        predicted = pred.pipelines[0].stages[stage].peak_memory_bytes - FRAMEWORK_OVERHEAD["nvidia"]
        recorded = record_stage(model, plan, 0, stage).lower_bound_bytes()
        assert abs(predicted / recorded - 1) < 0.10, (case, stage, predicted, recorded)


def test_the_runtime_sums_gradients_through_one_buffer_and_back_in_place():
    """hetero.runtime.grads.sync_gradients on one bucket of a stage's gradients: at its peak the
    parameters (W), the gradients (G) and one summed buffer (G), which the predictor charges; it
    cloned each summed tensor too (W + 3G) before the sums went back into the gradients."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hetero
    from hetero.memplan.record import AllocationRecorder
    from hetero.runtime.grads import Bucket, sync_gradients
    from hetero.runtime.model import StageModel

    class NoComm:
        def all_reduce_async(self, t, ranks, label=""):
            return _Done()

    model = hetero.load_model({**TINY, "num_layers": 2})
    rec = AllocationRecorder()
    with FakeTensorMode(), rec:
        stage = StageModel(model, (0, 2), True, True)
        names = [n for n, _ in stage.named_parameters()]
        for p in stage.parameters():
            p.grad = torch.empty_like(p)
        sync_gradients(stage, [Bucket((0, 1), tuple(names))], {n: (0, 1) for n in names}, NoComm(), 1)
    G = sum(p.numel() for p in stage.parameters()) * 4
    assert AllocationTrace(list(rec.events)).lower_bound_bytes() == 3 * G   # W + G + the buffer


def test_gradients_bound_to_their_buffer_are_summed_and_reduce_scattered_without_a_copy():
    """Without tensor parallelism the runtime binds a bucket's gradients to one buffer before the
    first backward (hetero.runtime.grads.bind_gradient_buffers): backward accumulates into it, the
    sum all-reduces it in place (peak W + G, one gradient copy less than above), and ZeRO's
    reduce-scatter takes it as its input (W + G + the G / k output slice). The sums are the same."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hetero
    from hetero.memplan.record import AllocationRecorder
    from hetero.runtime.grads import Bucket, bind_gradient_buffers, sync_gradients
    from hetero.runtime.model import StageModel
    from hetero.runtime.zero import ShardedAdamW

    class Doubling:   # two identical replicas: every sum is twice the gradient
        def all_reduce_async(self, t, ranks, label=""):
            t.mul_(2)
            return _Done()

        def reduce_scatter_async(self, out, flat, ranks, label=""):   # in place, as the libraries' own
            out.copy_(flat.view(len(ranks), -1)[ranks.index(0)]).mul_(2)
            return _Done()

        def crosses_vendors(self, ranks):   # one vendor: ZeRO reduce-scatters (across vendors it all-reduces)
            return False

    model = hetero.load_model({**TINY, "num_layers": 2})
    torch.manual_seed(0)
    stage = StageModel(model, (0, 2), True, True)
    names = tuple(n for n, _ in stage.named_parameters())
    bucket, holders = Bucket((0, 1), names), {n: (0, 1) for n in names}
    x = torch.randint(0, model.vocab_size, (2, model.seq_length))

    def backward():
        stage(x).float().pow(2).mean().backward()

    backward()
    expected = {n: 2 * p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    buffers = bind_gradient_buffers(stage, [bucket])
    (flat,) = buffers.values()
    backward()
    assert all(p.grad._base is flat for p in stage.parameters())
    sync_gradients(stage, [bucket], holders, Doubling(), 1, buffers)
    for n, p in stage.named_parameters():
        assert torch.allclose(p.grad, expected[n]), n

    def peak(zero: bool) -> int:
        rec = AllocationRecorder()
        with FakeTensorMode(), rec:
            stage = StageModel(model, (0, 2), True, True)
            sharded = ShardedAdamW(stage, [bucket], Doubling(), 0, 1, 1e-3, 0.0) if zero else None
            if zero:
                sharded.bind_gradient_buffers()
            else:
                buffers = bind_gradient_buffers(stage, [bucket])
            for p in stage.parameters():   # what backward accumulates, in place
                p.grad.add_(1.0)
            if zero:
                sharded.reduce_gradients()
            else:
                sync_gradients(stage, [bucket], holders, Doubling(), 1, buffers)
        return AllocationTrace(list(rec.events)).lower_bound_bytes()

    P = sum(p.numel() for p in stage.parameters())
    assert peak(False) == 2 * 4 * P                               # W + G: no copy of the gradients
    assert peak(True) == pytest.approx(2 * 4 * P + 4 * P / 2, rel=1e-3)   # + the reduce-scatter's slice


class _Done:
    """A collective already completed (the fakes above sum at once)."""

    def wait(self) -> None:
        pass
