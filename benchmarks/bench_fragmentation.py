"""What PyTorch's caching allocator reserves on top of a stage's live peak: the data the predictor's
fragmentation model (predictor/allocator.py) is fitted on.

    python benchmarks/bench_fragmentation.py [OUT.json]   (default predictor/data/caching_fragmentation.json)
    python benchmarks/bench_fragmentation.py --fit         (writes benchmarks/results/allocator_fit.json)
    python benchmarks/bench_fragmentation.py --deep        (writes benchmarks/results/caching_replay_deep.json)

Method: the runtime's stages at full width (GPT-2-large, GPT-3 1.3B, Llama-2-7B cut to 4-6 layers;
fp32 / bf16 / fp16, tp 2, ZeRO-1, no / selective / full recomputation, 1F1B / GPipe / interleaved,
micro-batch sizes 1-4) are recorded for two training steps on fake tensors (hetero.memplan.record),
then the caching allocator's replay (hetero.memplan.caching, exact to the byte against an H100 with the
driver's segment addresses) gives what it reserves. Per stage it writes the recorded lower bound, the
replay's reservation (and its reservation when the live bytes first reached their peak: the
fragmentation the peak's own composition causes), the predictor's live peak for the same stage (framework overhead left out:
no tensor holds it), and the tensor sizes that decide the caching allocator's segments.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetero  # noqa: E402
from hetero.memplan.arena import plan_arena  # noqa: E402
from hetero.memplan.caching import simulate_caching_allocator  # noqa: E402
from hetero.memplan.record import record_stage  # noqa: E402


def _sized(name, layers, **over):
    d = hetero.load_model(ROOT / f"configs/models/{name}.yaml").to_dict()
    d.update(num_layers=layers, attention="fused", **over)   # the runtime runs SDPA
    return hetero.load_model(d)


def _even(L, stages, tp=1, m=4, replicas=1, mbs=1, **over):
    cuts = [round(i * L / stages) for i in range(stages + 1)]
    plan = {"global_batch_size": m * replicas * mbs, "micro_batch_size": mbs, "schedule": "1f1b",
            "pipelines": [{"replicas": replicas, "micro_batches": m,
                           "stages": [{"group": "a100", "layers": [cuts[i], cuts[i + 1]], "tp": tp}
                                      for i in range(stages)]}]}
    plan.update(over)
    return plan


CASES = {
    "gpt2-large bf16": ("gpt2-large", 4, {"dtype": "bf16"}, _even(4, 2)),
    "gpt2-large bf16 mbs4 selective": ("gpt2-large", 4, {"dtype": "bf16"}, _even(4, 2, mbs=4, recompute="selective")),
    "gpt2-large fp32": ("gpt2-large", 4, {}, _even(4, 2)),
    "gpt2-large fp32 mbs2 full": ("gpt2-large", 4, {}, _even(4, 2, mbs=2, recompute="full")),
    "llama2-7b bf16 tp2": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, tp=2)),
    "llama2-7b bf16 zero1 x2": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, replicas=2, zero_stage=1)),
    "llama2-7b bf16 full": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, recompute="full")),
    "llama2-7b bf16 selective mbs2": ("llama2-7b", 4, {"seq_length": 2048}, _even(4, 2, mbs=2, recompute="selective")),
    "llama2-7b full x2 seq512": ("llama2-7b", 4, {"seq_length": 512}, _even(4, 2, replicas=2, recompute="full")),
    "llama2-7b zero1 x2 seq512": ("llama2-7b", 4, {"seq_length": 512}, _even(4, 2, replicas=2, zero_stage=1)),
    "gpt3-1.3b fp16 gpipe": ("gpt3-1.3b", 4, {}, _even(4, 2, schedule="gpipe")),
    "gpt3-1.3b bf16 mbs2": ("gpt3-1.3b", 4, {"dtype": "bf16"}, _even(4, 2, mbs=2)),
    "gpt3-1.3b bf16 interleaved": ("gpt3-1.3b", 6, {"dtype": "bf16"},
                                   {**_even(6, 6), "schedule": "interleaved", "interleave": 2}),
}


DEEP_CASES = {
    # stages deeper than the predictor records (allocator.REPLAY_DEPTH): its reservation is extrapolated
    "gpt2-large bf16 x16": ("gpt2-large", 16, {"dtype": "bf16"}, _even(16, 2)),
    "gpt2-large fp32 mbs2 full x12": ("gpt2-large", 12, {}, _even(12, 2, mbs=2, recompute="full")),
    "gpt2-large bf16 mbs4 selective x12": ("gpt2-large", 12, {"dtype": "bf16"},
                                           _even(12, 2, mbs=4, recompute="selective")),
    "llama2-7b bf16 tp2 x14": ("llama2-7b", 14, {"seq_length": 2048}, _even(14, 2, tp=2)),
    "llama2-7b zero1 x2 seq512 x14": ("llama2-7b", 14, {"seq_length": 512},
                                      _even(14, 2, replicas=2, zero_stage=1)),
    "llama2-7b full x2 seq512 x12": ("llama2-7b", 12, {"seq_length": 512}, _even(12, 2, replicas=2, recompute="full")),
    "llama2-7b bf16 selective mbs2 x12": ("llama2-7b", 12, {"seq_length": 2048},
                                          _even(12, 2, mbs=2, recompute="selective")),
    "gpt3-1.3b fp16 gpipe x16": ("gpt3-1.3b", 16, {}, _even(16, 2, schedule="gpipe")),
    "gpt3-1.3b bf16 interleaved x36": ("gpt3-1.3b", 36, {"dtype": "bf16"},
                                       {**_even(36, 6), "schedule": "interleaved", "interleave": 2}),
}


def deep_rows(name: str) -> list[dict]:
    """Per stage of a deep case: the replay of its full recording against the predictor's
    (allocator.simulated_caching_bytes: recorded at 4 layers per chunk, deepened by repeating a layer's
    requests), with the time of each."""
    from hetero.predictor.allocator import _REPLAYS, simulated_caching_bytes

    arch, layers, over, plan_d = DEEP_CASES[name]
    model, plan = _sized(arch, layers, **over), hetero.load_plan(plan_d)
    rows = []
    for stage in range(len(plan.physical_stages(plan.pipelines[0]))):
        t0 = time.perf_counter()
        replay = simulate_caching_allocator(record_stage(model, plan, 0, stage)).reserved_bytes
        t1 = time.perf_counter()
        _REPLAYS.clear()
        predicted = simulated_caching_bytes(model, plan, 0, stage)
        t2 = time.perf_counter()
        rows.append({"case": name, "stage": stage, "caching_reserved_bytes": replay,
                     "predicted_reserved_bytes": predicted, "error": predicted / replay - 1,
                     "record_seconds": t1 - t0, "predict_seconds": t2 - t1})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def stage_rows(name: str, cluster) -> list[dict]:
    arch, layers, over, plan_d = CASES[name]
    from hetero.predictor.memory import FRAMEWORK_OVERHEAD

    model, plan = _sized(arch, layers, **over), hetero.load_plan(plan_d)
    pred = hetero.predict(cluster, model, plan)
    rows = []
    for stage in range(len(plan.physical_stages(plan.pipelines[0]))):
        t0 = time.perf_counter()
        trace = record_stage(model, plan, 0, stage)
        replay = simulate_caching_allocator(trace)
        sizes = sorted({e[2] for e in trace.events if e[0] == "alloc"})
        sp = pred.pipelines[0].stages[stage]
        br = sp.memory_breakdown
        rows.append({"case": name, "stage": stage, "lower_bound_bytes": trace.lower_bound_bytes(),
                     "caching_reserved_bytes": replay.reserved_bytes, "segments": replay.segments,
                     "caching_reserved_at_live_peak_bytes": replay.reserved_at_live_peak_bytes,
                     "arena_bytes": plan_arena(trace).arena_bytes,
                     "predicted_live_bytes": sp.peak_memory_bytes - FRAMEWORK_OVERHEAD["nvidia"],
                     "predicted_state_bytes": br.weights + br.gradients + br.optimizer,
                     "predicted_activation_bytes": br.activations,
                     "largest_block_bytes": sizes[-1], "events": len(trace.events),
                     "seconds": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _summary(errors: list[dict]) -> dict:
    e = sorted(abs(x["error"]) for x in errors)
    n = len(e)
    return {"median_abs_error": (e[(n - 1) // 2] + e[n // 2]) / 2, "max_abs_error": e[-1],
            "within_5_percent": sum(x <= 0.05 for x in e), "too_little": sum(x["error"] < 0 for x in errors)}


def write_fit(out: Path) -> None:
    """The fitted coefficients and each stage's error, in-sample and held out (leave one out)."""
    from hetero.predictor import allocator

    res = {"method": "hetero.predictor.allocator fitted on predictor/data/caching_fragmentation.json "
                     "(benchmarks/bench_fragmentation.py); error: the model's reservation for the predictor's "
                     "live peak of each recorded stage against the caching allocator's replay (caching) or the "
                     "greedy arena (planned) of the recorded trace; held_out: each stage's error with the "
                     "coefficients fitted on the other stages only"}
    for kind in allocator.KINDS:
        a, b = allocator.coefficients(kind)
        fit, held = allocator.fit_errors(kind), allocator.held_out_errors(kind)
        res[kind] = {"coefficients": {"states": a, "activations": b}, **_summary(fit),
                     "held_out": _summary(held),
                     "stages": [{**f, "held_out_error": h["error"]} for f, h in zip(fit, held)]}
        print(kind, json.dumps({k: v for k, v in res[kind].items() if k != "stages"}))
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


def main() -> int:
    if sys.argv[1:] == ["--deep"]:
        rows = [r for name in DEEP_CASES for r in deep_rows(name)]
        out = ROOT / "benchmarks/results/caching_replay_deep.json"
        out.write_text(json.dumps({"method": "per stage: the caching allocator's replay of the stage's full "
                                   "recording (hetero.memplan.record, two steps) against "
                                   "hetero.predictor.allocator.simulated_caching_bytes (the same stage recorded "
                                   "at REPLAY_DEPTH layers per chunk at most, deepened by "
                                   "hetero.memplan.expand.expand_layers); "
                                   "seconds on a shared 2-core CPU", **_summary(rows), "stages": rows}, indent=1))
        print(json.dumps(_summary(rows)))
        print(f"wrote {out}")
        return 0
    if sys.argv[1:] == ["--fit"]:
        write_fit(ROOT / "benchmarks/results/allocator_fit.json")
        return 0
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "predictor/data/caching_fragmentation.json"
    cluster = hetero.load_cluster(ROOT / "configs/clusters/a100-homogeneous.yaml")
    rows = [r for name in CASES for r in stage_rows(name, cluster)]
    out.write_text(json.dumps({"method": __doc__.split("Method: ")[1].strip(), "stages": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
