"""One process of a ``hetero rl`` run (started by ``hetero.runtime.worker`` when the run file comes
with an RL description, :data:`RL_ENV`).

The run is one torchrun world: ranks ``0 .. A - 1`` are the actor plan's ranks (the training
runtime's engine, trained with the GRPO loss), ranks ``A ..`` the rollout ranks of a disaggregated
placement (a whole model copy each). Collocated, there are no rollout ranks: each actor rank syncs
the weights into a temporary whole copy, generates its share of the step's groups, and frees the
copy (and its KV cache) before training. A step:

1. weights of version ``v`` (``v`` updates done) reach every whole copy (:mod:`hetero.rl.sync`);
2. each generating rank samples its prompt groups (:mod:`hetero.rl.rollout`), scores them with the
   reward pool (one batch a step) and sends each group down the channel (:mod:`hetero.rl.channel`);
3. the actor trains one update on the step's samples as they arrive (:mod:`hetero.rl.actor`).

With ``staleness: k`` the rollout ranks generate step ``t`` with version ``max(0, t - k)`` while the
actor still trains earlier steps; every sample records the version that made it.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
import traceback

import torch

RL_ENV = "HETERO_RL_RUN"
"""The RL description (``rl.json`` beside the run file) every process of an RL run reads."""
STAT_FIELDS = ("tokens", "loss_sum", "kl_sum", "clipped", "reward_sum", "samples", "rollout_s", "sync_s",
               "version", "max_lag")


def main(spec_path: str) -> int:
    """Run this process's part; its pid / ready / done / error files as the training worker's."""
    from hetero.runtime.spec import RunSpec
    from hetero.runtime.spec import derive_rank
    from hetero.runtime.spec import write_rank_file as _write

    spec = RunSpec.load(spec_path)
    with open(os.environ[RL_ENV]) as f:
        cfg = json.load(f)
    rank = derive_rank(spec)
    base = os.path.join(spec.options.run_dir, f"rank{rank}")
    _write(base + ".pid", str(os.getpid()))
    phase = {"phase": "setting up"}
    try:
        RLProcess(spec, cfg, rank, base, phase).run()
        _write(base + ".done", "ok")
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        from hetero.errors import HeteroError

        where = describe_rl_rank(spec, cfg, rank)
        msg = str(e) if isinstance(e, HeteroError) else f"{type(e).__name__}: {e}"
        _write(base + ".error.json", json.dumps({
            "rank": rank, "time": time.time(), "step": 0, "phase": phase["phase"], "kind": "exception",
            "where": where, "message": msg, "traceback": traceback.format_exc()[-4000:]}))
        print(f"[hetero rl] {where}: {msg}", file=sys.stderr, flush=True)
        return 1


def describe_rl_rank(spec, cfg: dict, rank: int) -> str:
    """How errors name world rank ``rank``: an actor rank as the training runtime does, a rollout rank by its group."""
    from hetero.runtime.spec import describe_rank

    actors = len(spec.layout)
    if rank < actors:
        return describe_rank(spec.rank_layout().ranks[rank])
    return f"rank {rank} (rollout, group {cfg['rollout'][rank - actors]['group']})"


class RLProcess:
    """One rank of the run: its communicator, its role(s) and the step loop."""

    def __init__(self, spec, cfg: dict, rank: int, base: str, phase: dict):
        import hetero
        from hetero.runtime.collectives import Collectives
        from hetero.runtime.device import rank_device, torch_device_type
        from hetero.runtime.parallel import ParallelLayout
        from hetero.runtime.spec import write_rank_file as _write

        self.spec, self.cfg, self.rank, self.phase = spec, cfg, rank, phase
        job = self.job = cfg["job"]
        opts = spec.options
        torch.manual_seed(opts.seed)
        torch.set_num_threads(max(1, opts.threads))
        self.cluster = hetero.load_cluster(spec.cluster)
        self.model = hetero.load_model(spec.model)
        self.plan = hetero.load_plan(spec.plan)
        self.layout = spec.rank_layout()
        self.A = len(self.layout.ranks)
        rollout = cfg["rollout"]
        self.world = self.A + len(rollout)
        vendors = [r.vendor for r in self.layout.ranks] + [r["vendor"] for r in rollout]
        families = [self.cluster.device_type(r.group).family for r in self.layout.ranks] + \
            [self.cluster.device_type(r["group"]).family for r in rollout]
        self.device = rank_device(families[rank])
        groups = [r.group for r in self.layout.ranks] + [r["group"] for r in rollout]
        self.slowdown = float(self.cluster.device_type(groups[rank]).slowdown)
        """An emulated slower device generates as training computes on it: really, then waits."""
        self.comm = Collectives.init(rank, self.world, opts.timeout_s, describe=self.describe, vendors=vendors,
                                     device=self.device, device_types=[torch_device_type(f) for f in families])
        _write(base + ".ready", "ok")
        parallel = ParallelLayout.build(self.model, self.plan, self.layout, rank if rank < self.A else 0)
        self.actor_ranks = list(range(self.A))
        # collocated: the actor ranks of the rollout's groups (default: every actor rank) generate
        self.gen_ranks = list(range(self.A, self.world)) if rollout else \
            [r.rank for r in self.layout.ranks if r.group in cfg["rollout_groups"]]
        self.comm.create_groups(list(parallel.group_sets) + [self.actor_ranks, list(range(self.world))],
                                mesh_sets=parallel.mesh_sets)
        self.is_actor = rank < self.A
        self.generates = rank in self.gen_ranks
        self.disaggregated = bool(rollout)
        P, G = job["prompts_per_step"], job["group_size"]
        owners = [self.gen_ranks[g % len(self.gen_ranks)] for g in range(P)]
        from hetero.rl.channel import Channel
        from hetero.rl.sync import WeightSync

        self.channel = Channel(self.comm, rank, self.plan, self.layout, owners, G, self.model.seq_length)
        self.sync = WeightSync(self.model, self.plan, self.layout, self.gen_ranks,
                               dict(enumerate(vendors)), cfg.get("bucket_mb", 25.0))
        self.sync_comm = self.comm.with_own_sends()
        self.steps = cfg["steps"]
        self.staleness = job["staleness"] if self.disaggregated else 0
        self.eval_results: dict[str, list] = {"before": [], "after": []}
        self.whole = self.whole_params = self.ref = None
        if self.is_actor:
            self._build_actor()
        if self.generates:
            self._build_rollout()

    def describe(self, r: int) -> str:
        return describe_rl_rank(self.spec, self.cfg, r)

    # ------------------------------------------------------------------ roles
    def _build_actor(self) -> None:
        from hetero.rl.actor import GRPOLoss, SampleSource
        from hetero.runtime.context import RunContext
        from hetero.runtime.engine import NativeEngine

        self.phase["phase"] = "building the actor"
        ctx = RunContext(self.spec, self.rank)
        acomm = self.comm.with_own_sends()
        acomm.world_size = self.A   # the engine's run-wide collectives are the actor's
        self.engine = NativeEngine(ctx, acomm)
        if self.spec.options.load:
            self._load(self.spec.options.load)
        job = self.job
        self.source = SampleSource(self.channel, job["prompts_per_step"] * job["group_size"], job["group_size"],
                                   self.model.seq_length, ctx.last)
        self.engine.source = self.source
        self.loss = GRPOLoss(job["clip"], job["kl_coef"], job["temperature"])
        self.engine.loss_fn = self.loss
        me = ctx.me
        # the one rank that reports the step's rewards and rollout times: pipeline 0 replica 0's last stage
        self.reporter = ctx.last and (me.pipeline, me.replica, me.tp_rank) == (0, 0, 0)
        self.counts_loss = ctx.last and me.tp_rank == 0

    def _load(self, path: str) -> None:
        """The starting weights (a ``--save`` checkpoint or ``hf:DIR``); the optimizer starts afresh, as
        an RL run after a warm start does. DCP's load is a collective of the whole world: the rollout
        ranks join it with nothing to read."""
        from hetero.hf import hf_dir_of

        if hf_dir_of(path) is not None:
            if self.is_actor:
                self.engine.load(path)
            return
        import torch.distributed.checkpoint as dcp

        from hetero.runtime.checkpoint import SafeReader, load_checkpoint

        if not self.is_actor:
            dcp.load({}, storage_reader=SafeReader(path))
            return
        load_checkpoint(path, self.engine.module, None, num_layers=self.model.num_layers)
        if self.engine.sharded:   # ZeRO's masters take the loaded weights
            self.engine.sharded.retake_masters()

    def _build_rollout(self) -> None:
        from hetero.rl.prompts import PromptRecord
        from hetero.rl.rewards import RewardPool, RewardRef
        from hetero.tokenizer import load_text_tokenizer

        self.phase["phase"] = "building the rollout"
        job = self.job
        self.tokenizer = load_text_tokenizer(job["tokenizer"], self.model.vocab_size, "tokenizer")
        self.prompts = [PromptRecord(*p) for p in self.cfg["prompts"]]
        self.eval_prompts = [PromptRecord(*p) for p in self.cfg["eval_prompts"]]
        self.rewards = RewardPool(RewardRef(**self.cfg["reward"]), workers=self.cfg.get("reward_workers", 1),
                                  timeout_s=self.spec.options.timeout_s)
        self.index = self.gen_ranks.index(self.rank)
        if self.spec.options.load and not self.is_actor:
            self._load(self.spec.options.load)

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        rows = []
        try:
            if self.is_actor:
                rows = self._actor_loop()
            else:
                self._rollout_loop()
            self.phase["phase"] = "finishing"
            self._finish(rows)
        finally:
            if self.generates:
                self.rewards.close()
        self.comm.shutdown()

    def _actor_loop(self) -> list[dict]:
        from hetero.runtime.pipeline import Timings

        rows = []
        params = self._params
        for t in range(self.steps):
            self.phase["phase"] = f"step {t + 1}"
            t0 = time.perf_counter()
            if self.disaggregated:
                self.sync_comm.wait_sends()   # the last version's buckets have landed
                self.sync.send(self.sync_comm, self.rank, params(), t)
            else:
                self._collocated_rollout(t)
            self.loss.begin_step(t)
            self._trim_rows(t)
            t1 = time.perf_counter()
            self.engine.train_step(t, Timings())
            train_s = time.perf_counter() - t1
            stats = self._step_stats(t)
            self.channel.drop_step(t)
            step_s = time.perf_counter() - t0
            row = self._row(t, stats, train_s, step_s)
            rows.append(row)
            if self.rank == 0 and not self.cfg.get("quiet"):
                print(f"step {t + 1}/{self.steps}  reward {row['reward_mean']:.4f}  loss {row['loss']:.5f}  "
                      f"rollout {row['rollout_s']:.3f} s  train {row['train_s']:.3f} s  sync {row['sync_s']:.3f} s",
                      flush=True)
        self.channel.wait_sent(self.steps)   # collocated: the groups this rank sent its peers
        if self.disaggregated:
            self.sync_comm.wait_sends()
            if self.cfg["eval_prompts"]:   # the final weights, for the evaluation after the last step
                self.sync.send(self.sync_comm, self.rank, params(), self.steps)
                self.sync_comm.wait_sends()
        elif self.cfg["eval_prompts"]:
            self._collocated_sync(self.steps)
            if self.generates:
                self.eval_results["after"] = self._evaluate()
            self._free_whole()
        return rows

    def _trim_rows(self, t: int) -> None:
        """Train step ``t`` on rows of its longest possible sample rather than of seq_length: the
        source's rows and the pipeline's activation shape, both from the job alone (every stage of
        every pipeline computes the same length)."""
        from hetero.rl.rollout import step_row_length

        job = self.job
        length = step_row_length(job["seed"], t, job["prompts_per_step"], self.cfg["prompt_lengths"],
                                 job["max_new_tokens"], self.model.seq_length)
        self.source.length = length
        shape = self.engine.executor.act_shape
        self.engine.executor.act_shape = (shape[0], length, *shape[2:])

    def _params(self) -> dict:
        from hetero.rl.sync import local_params

        self.engine.settle()   # ZeRO's parameter gathers
        return local_params(self.engine.module)

    def _collocated_sync(self, version: int) -> float:
        """Every actor rank sends its pieces; the generating ones fill their temporary whole copy."""
        from hetero.rl.sync import whole_model

        t0 = time.perf_counter()
        if self.whole is None and self.generates:
            self.whole, self.whole_params = whole_model(self.model, self.device)
        params = self._params()
        self.sync.send(self.sync_comm, self.rank, params, version)
        self.sync.receive(self.sync_comm, self.rank, self.whole_params, version, params)
        self.sync_comm.wait_sends()
        seconds = time.perf_counter() - t0
        self.sync.log.seconds += seconds
        return seconds

    def _free_whole(self) -> None:
        self.whole = self.whole_params = None

    def _collocated_rollout(self, t: int) -> None:
        sync_s = self._collocated_sync(t)
        if not self.generates:
            return
        if t == 0:
            self._keep_reference()
            if self.cfg["eval_prompts"]:
                self.eval_results["before"] = self._evaluate()
        self._generate_step(t, t, sync_s)
        self._free_whole()   # the copy and its KV cache go before training

    def _keep_reference(self) -> None:
        if self.job["kl_coef"] > 0:
            self.ref = copy.deepcopy(self.whole)

    def _rollout_loop(self) -> None:
        received = -1
        for t in range(self.steps):
            self.phase["phase"] = f"rollout of step {t + 1}"
            need = max(0, t - self.staleness)
            sync_s = 0.0
            while received < need:
                received += 1
                sync_s += self._receive(received)
                if received == 0:
                    self._keep_reference()
            if t == 0 and self.eval_prompts:
                self.eval_results["before"] = self._evaluate()
            self._generate_step(t, received, sync_s)
        last = self.steps if self.eval_prompts else self.steps - 1
        while received < last:
            received += 1
            self._receive(received)
        if self.eval_prompts:
            self.eval_results["after"] = self._evaluate()
        self.channel.wait_sent(self.steps)

    def _receive(self, version: int) -> float:
        from hetero.rl.sync import whole_model

        t0 = time.perf_counter()
        if self.whole is None:
            self.whole, self.whole_params = whole_model(self.model, self.device)
        self.sync.receive(self.sync_comm, self.rank, self.whole_params, version)
        seconds = time.perf_counter() - t0
        self.sync.log.seconds += seconds
        return seconds

    # ------------------------------------------------------------------ generation
    def _generate_step(self, t: int, version: int, sync_s: float) -> None:
        from hetero.rl.generate import generate
        from hetero.rl.rollout import groups_of, step_prompts
        from hetero.runtime.device import waiter
        from hetero.runtime.pipeline import timed

        job = self.job
        P, G = job["prompts_per_step"], job["group_size"]
        chosen = step_prompts(job["seed"], t, P, len(self.prompts))
        t0 = time.perf_counter()
        made = []
        for g in groups_of(self.index, len(self.gen_ranks), P):
            record = self.prompts[chosen[g]]
            ids = self.tokenizer.encode(record.prompt, special=True)
            done, _, _ = timed(lambda: generate(
                self.whole, [ids], max_new_tokens=job["max_new_tokens"], temperature=job["temperature"],
                seed=job["seed"], step=t, samples=G, prompt_indices=[g], stop=job["stop"],
                tokenizer=self.tokenizer, batch_rows=G), self.slowdown, waiter(self.device))
            made.append((g, record, ids, done))
        # one batch for the reward pool: a round trip to its processes (a few ms on loaded cores) costs
        # more than generating a group of a small model, and scoring on a thread beside the generation
        # slowed the generation more than it hid
        rewards = self.rewards.score([record for _, record, _, _ in made for _ in range(G)],
                                     [c.text for *_, done in made for c in done])
        for k, (g, _, ids, done) in enumerate(made):
            self._put_group(t, version, sync_s, t0, g, ids, [c.tokens for c in done], rewards[k * G:(k + 1) * G])
        self.channel.wait_sent(t - self.staleness - 1)

    def _put_group(self, t: int, version: int, sync_s: float, t0: float, g: int, ids: list[int],
                   comps: list[list[int]], rewards: list[float]) -> None:
        """Group ``g`` of step ``t`` down the channel: its advantages, reference log-probs, row."""
        from hetero.rl.grpo import group_advantages
        from hetero.rl.rollout import pack_group, sequence_logprobs

        job, G = self.job, self.job["group_size"]
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), G)
        ref = None
        if self.ref is not None:
            L = max(len(ids) + len(c) for c in comps)
            seq = torch.zeros(G, L, dtype=torch.int64)
            for j, c in enumerate(comps):
                seq[j, :len(ids) + len(c)] = torch.tensor(ids + c)
            ref = sequence_logprobs(self.ref, seq.to(self.device), job["temperature"])
        rows = pack_group(t, g, version, ids, comps, rewards, adv, ref, self.model.seq_length, sync_s,
                          time.perf_counter() - t0)
        self.channel.put(t, g, rows)

    def _evaluate(self) -> list[tuple[int, float]]:
        """Greedy completions of this rank's share of the eval prompts, scored: (prompt index, reward)."""
        from hetero.rl.generate import generate

        mine = list(range(self.gen_ranks.index(self.rank), len(self.eval_prompts), len(self.gen_ranks)))
        texts = []
        for i in mine:
            ids = self.tokenizer.encode(self.eval_prompts[i].prompt, special=True)
            done = generate(self.whole, [ids], max_new_tokens=self.job["max_new_tokens"], temperature=0.0,
                            stop=self.job["stop"], tokenizer=self.tokenizer, batch_rows=1)
            texts.append(done[0].text)
        # one batch for the reward pool, as a step's groups
        return list(zip(mine, self.rewards.score([self.eval_prompts[i] for i in mine], texts)))

    # ------------------------------------------------------------------ statistics and summary
    def _step_stats(self, t: int) -> dict:
        """The step's figures, summed over the actor ranks (one all-reduce)."""
        vec = torch.zeros(len(STAT_FIELDS), dtype=torch.float64)
        if self.counts_loss:
            vec[:4] = self.loss.stats.as_tensor()
        if self.reporter:
            groups = [self.channel.group(t, g) for g in range(self.job["prompts_per_step"])]
            allrows = torch.cat(groups)
            vec[4] = float(allrows[:, 4].sum())
            vec[5] = allrows.shape[0]
            vec[6] = float(allrows[:, -1].max())
            vec[7] = float(allrows[:, -2].max())
            vec[8] = float(allrows[:, 3].min())
            vec[9] = float((t - allrows[:, 3]).max())
        self.engine.comm.all_reduce(vec)
        return dict(zip(STAT_FIELDS, vec.tolist()))

    def _row(self, t: int, s: dict, train_s: float, step_s: float) -> dict:
        tokens = s["tokens"] or 1.0
        return {"step": t, "reward_mean": s["reward_sum"] / max(s["samples"], 1.0), "loss": s["loss_sum"] / tokens,
                "kl": s["kl_sum"] / tokens, "rollout_s": s["rollout_s"], "train_s": train_s, "sync_s": s["sync_s"],
                "step_s": step_s, "policy_version": int(s["version"]), "max_staleness": int(s["max_lag"]),
                "clip_fraction": s["clipped"] / tokens, "completion_tokens": int(s["tokens"])}

    def _finish(self, rows: list[dict]) -> None:
        from hetero.rl.sync import checksums_match

        mine = {"sync": self.sync.log, "eval": self.eval_results}
        gathered = self.comm.all_gather_object(mine)
        if self.cfg.get("save"):
            self._save(self.cfg["save"])
        if self.rank != 0:
            return
        logs = [g["sync"] for g in gathered]
        match, compared = checksums_match(logs)
        syncs = len({k[0] for log in logs for k in log.received})
        evals = {}
        for when in ("before", "after"):
            got = [r for g in gathered for _, r in g["eval"][when]]
            if got:
                evals[when] = {"reward_mean": statistics.fmean(got)}
        received = sum(log.bytes_received for log in logs)
        own = sum(p.numel * 4 for p in self.sync.pieces if p.src == p.dst)
        summary = {"algorithm": "grpo", "steps": len(rows), "placement": self.cfg["placement"], "rl_steps": rows,
                   "eval": evals,
                   "weight_sync": {"syncs": syncs, "bytes_per_sync": (received + own * syncs) // max(syncs, 1),
                                   "seconds_total": max(log.seconds for log in logs),
                                   "checksums_match": match, "pieces_checked": compared},
                   "predicted": None}
        from hetero.specs.io import write_text_atomic

        write_text_atomic(self.cfg["summary_path"], json.dumps(summary, indent=2), "--summary")

    def _save(self, path: str) -> None:
        """The actor's checkpoint (as ``hetero launch --save`` writes it); DCP's collectives span the
        whole world, so the rollout ranks join them with nothing to write."""
        self.phase["phase"] = "saving the checkpoint (--save)"
        if self.is_actor:
            self.engine.save(path, self.steps)
        else:
            import torch.distributed.checkpoint as dcp

            from hetero.runtime.checkpoint import staging_dir

            dcp.save({}, checkpoint_id=staging_dir(path))


