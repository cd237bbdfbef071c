"""What rank 0 prints: the run header, one line per step, per-rank times and predicted vs measured."""
from __future__ import annotations

import statistics

from hetero.specs.units import plural


MIN_STEADY_STEPS = 5
"""Steps after the warm-up one (its first allocations, page faults and connections; the summary's
figures leave it out) that predicted vs measured needs: with fewer, one slow step on a shared
machine moves the median, and the error is not printed as a verdict."""


ERROR_TO_EXPLAIN = 0.15
"""Beyond this error (either way) the report looks for why: the predictor's target on the shipped
examples (docs/benchmarks.md)."""

COMPUTE_DRIFT = 0.10
"""When every rank's measured compute per micro-batch departs from its prediction by more than this,
the same way, the machine's speed moved since its profile (a virtual machine's neighbours move it by
up to half over hours)."""


class Reporter:
    """Rank 0's console output for a run: header, one line per step, footer tables."""

    def __init__(self, trainer):
        from hetero.console import console

        self.t = trainer
        self.out = console()

    def header(self) -> None:
        ctx = self.t.ctx
        self.out.print(f"[bold]hetero launch[/bold]: {ctx.model.name} on {ctx.cluster.name}, "
                       f"{plural(self.t.world, 'rank')}, engine {ctx.options.engine}, schedule {ctx.plan.schedule}, "
                       f"global batch {ctx.plan.global_batch_size}")
        self.out.print(f"plan: {ctx.plan.one_line()}")
        by_type: dict[str, list[int]] = {}
        for r, kind in enumerate(ctx.device_types):
            by_type.setdefault(kind, []).append(r)
        self.out.print("computes on: " + ", ".join(f"{kind} (ranks {_spans(ranks)})" for kind, ranks in by_type.items()))

    def step(self, r) -> None:
        tps = self.t.tokens_per_step / r.time_s if r.time_s > 0 else 0.0
        passes = self._passes(len(r.forward_s))
        # the rank computing longest in the step, as `hetero predict` names its bottleneck (most busy
        # time): a rank running more micro-batches can be the bottleneck though each is faster
        busiest = max(range(len(r.forward_s)), key=lambda i: passes[i] * (r.forward_s[i] + r.backward_s[i]))
        self.out.print(f"step {r.step:>4}  loss {r.loss:8.4f}  time {r.time_s * 1e3:8.1f} ms  "
                       f"{tps:10.0f} tok/s  |g| {r.grad_norm:7.3f}  bottleneck rank {busiest} "
                       f"({passes[busiest]} x F {r.forward_s[busiest] * 1e3:.1f} / B {r.backward_s[busiest] * 1e3:.1f} ms)"
                       + (f"  [yellow]gradient overflow at loss scale {r.loss_scale:g}: update skipped, "
                          f"scale halved[/yellow]" if r.skipped else ""))

    def _passes(self, world: int) -> list[int]:
        """Forward (and backward) passes per step of each rank: its pipeline's micro-batches times its
        model chunks; ones when the run's layout is not at hand or is not of this world size."""
        ctx = getattr(self.t, "ctx", None)
        ranks = getattr(getattr(ctx, "layout", None), "ranks", None)
        if not ranks or len(ranks) != world:
            return [1] * world
        return [ctx.plan.pipelines[info.pipeline].micro_batches * len(info.virtual_stages) for info in ranks]

    def footer(self, summary: dict) -> None:
        from rich.table import Table

        table = Table(title="per-rank compute per micro-batch (steady steps)")
        for col in ("rank", "group", "pipeline", "replica", "stage", "layers", "tp", "forward ms", "backward ms"):
            table.add_column(col, justify="right")
        for r in summary["ranks"]:
            layers = ", ".join(f"{a}-{b - 1}" for a, b in r.get("chunk_layers") or [r["layers"]])
            table.add_row(str(r["rank"]), r["group"], str(r["pipeline"]), str(r["replica"]), str(r["stage"]),
                          layers, f"{r['tp_rank']}/{r['tp_size']}",
                          f"{r['forward_time_s'] * 1e3:.2f}", f"{r['backward_time_s'] * 1e3:.2f}")
        self.out.print(table)
        measured = summary.get("median_iteration_time_s")
        pred = summary.get("predicted_iteration_time_s")
        cmp = Table(title="predicted vs measured")
        notes: list[str] = []
        for col in ("", "iteration time", "tokens/s"):
            cmp.add_column(col, justify="right")
        tokens = self.t.tokens_per_step
        cmp.add_row("measured (median)", f"{measured * 1e3:.1f} ms" if measured else "-",
                    f"{tokens / measured:.0f}" if measured else "-")
        steady = max(0, len(summary.get("iteration_times_s") or []) - 1)
        if pred and steady < MIN_STEADY_STEPS:
            cmp.add_row("predicted", f"{pred * 1e3:.1f} ms", f"{tokens / pred:.0f}")
            cmp.add_row("error", "n/a", "")
            notes.append(f"{steady} steady step(s) after the warm-up step: too short to judge the prediction "
                         f"(run at least {MIN_STEADY_STEPS + 1} steps)")
        elif pred:
            err = (pred - measured) / measured * 100 if measured else float("nan")
            cmp.add_row("predicted", f"{pred * 1e3:.1f} ms", f"{tokens / pred:.0f}")
            cmp.add_row("error", f"{err:+.1f} % (median of {steady} steady steps)", "")
            # each rank beside its stage's prediction: one predict() for every note below
            pairs = self._stage_pairs(summary["ranks"]) if abs(err) > ERROR_TO_EXPLAIN * 100 else []
            drift = self._compute_drift(pairs)
            if drift is not None and (drift < 0) == (err > 0):   # the compute moved the way the error did
                notes.append(f"every stage computed {abs(drift) * 100:.0f}% {'faster' if drift < 0 else 'slower'} "
                             f"per micro-batch than the prediction (the per-rank table above): the machine runs at "
                             f"another speed than when its profile was taken; run `hetero profile` again to "
                             f"compare at today's speed")
            if err < -50:
                slow = self._slowest_stage(pairs)
                if slow:   # the per-rank table shows compute itself far above its prediction: say that
                    notes.append(slow)
                else:
                    notes.append("the measured step is mostly per-step framework overhead the prediction leaves "
                                 "out (a model this small does little compute per step; every stage's compute is "
                                 "within 2x of its prediction); `hetero calibrate` on run logs fits that "
                                 "overhead, and a larger model is predicted closer")
        else:
            cmp.add_row("predicted", "n/a (predictor not available)", "")
        self.out.print(cmp)
        for note in notes:
            self.out.print(f"[bold]note[/bold] {note}")
        losses = ["nan" if x is None else f"{x:.4f}" for x in summary["losses"]]  # null: not finite
        if losses:
            self.out.print(f"loss {losses[0]} -> {losses[-1]} over {len(losses)} steps; "
                           f"mean step {statistics.fmean(summary['iteration_times_s']) * 1e3:.1f} ms")


    def _stage_pairs(self, ranks: list[dict]) -> list[tuple[dict, object]]:
        """(rank's summary row, its stage's prediction) for every rank of one stage (interleaved ranks
        run several chunks and are left out); empty when the predictor is not at hand."""
        try:
            import hetero

            ctx = self.t.ctx
            pred = hetero.predict(ctx.cluster, ctx.model, ctx.plan)
        except Exception:  # noqa: BLE001 - a missing or failing predictor leaves the general notes
            return []
        pairs = []
        for r in ranks:
            if r.get("chunk_layers"):
                continue
            try:
                pairs.append((r, pred.stage(r["pipeline"], r["stage"])))
            except (IndexError, KeyError):
                continue
        return pairs

    @staticmethod
    def _compute_drift(pairs: list[tuple[dict, object]]) -> float | None:
        """How far every rank's measured compute per micro-batch (forward + backward) sits from its
        stage's prediction (``pairs``: :meth:`_stage_pairs`), all in one direction: the smallest such
        departure (negative: faster), or None when some rank is within :data:`COMPUTE_DRIFT` of its
        prediction or they go both ways."""
        ratios = [((r.get("forward_time_s") or 0.0) + (r.get("backward_time_s") or 0.0))
                  / (sp.forward_time_s + sp.backward_time_s) - 1.0
                  for r, sp in pairs if sp.forward_time_s + sp.backward_time_s > 0]
        if not ratios or not (all(x > COMPUTE_DRIFT for x in ratios) or all(x < -COMPUTE_DRIFT for x in ratios)):
            return None
        return min(ratios, key=abs)

    @staticmethod
    def _slowest_stage(pairs: list[tuple[dict, object]]) -> str | None:
        """A note when a rank's measured compute per micro-batch (the per-rank table) is more than 2x
        its stage's predicted forward + backward (``pairs``: :meth:`_stage_pairs`), naming the worst;
        None when every rank is within 2x (or the prediction or the stage map is not at hand:
        interleaved ranks run several chunks)."""
        worst, worst_ratio = None, 2.0
        for r, sp in pairs:
            predicted = sp.forward_time_s + sp.backward_time_s
            measured = (r.get("forward_time_s") or 0.0) + (r.get("backward_time_s") or 0.0)
            if predicted > 0 and measured / predicted > worst_ratio:
                worst, worst_ratio = (r, sp), measured / predicted
        if worst is None:
            return None
        r, sp = worst
        shared = ("with tensor parallelism on CPU the all-reduces and the processes sharing cores count here"
                  if r["tp_size"] > 1 else "on CPU the processes sharing this machine's cores count here")
        return (f"the stages compute slower than predicted: rank {r['rank']} ({r['group']}, tp {r['tp_size']}) "
                f"takes {r['forward_time_s'] * 1e3:.2f} ms forward and {r['backward_time_s'] * 1e3:.2f} ms backward "
                f"per micro-batch against {sp.forward_time_s * 1e3:.2f} / {sp.backward_time_s * 1e3:.2f} ms predicted "
                f"({worst_ratio:.0f}x; the per-rank table above): {shared}; `hetero profile` on this machine, or "
                f"`hetero calibrate` on run logs, brings the prediction closer")


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r is None or r != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
    return ", ".join(out)
