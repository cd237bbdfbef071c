"""RL job files (``hetero rl JOB.yaml``): what to train (model, start weights, tokenizer), on what
(prompts, reward), how (GRPO's sizes and coefficients) and where (the placement of actor and rollout
on the cluster's groups). Paths in the file are relative to the file.

:func:`load_rl_job` checks every field the way cluster, model and plan files are checked (unknown
fields with a did-you-mean, types, ranges), then what the fields point at: the model file, the
checkpoint, the prompts files line by line, the reward (imported), the actor plan, and, given a
cluster, the placement's groups and whether actor and rollout fit on them.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

from hetero.specs.errors import Problem, Problems, SpecError, did_you_mean, join_path
from hetero.specs.io import read_mapping
from hetero.specs.schema import is_missing, load_dataclass

from .prompts import read_prompts


def _derived(default=None):
    """A field filled by :func:`load_rl_job`, not written in the file."""
    return dataclasses.field(default=default, init=False, repr=False, compare=False, metadata={"derived": True})


@dataclass(frozen=True)
class ActorPlacement:
    """Where the actor trains: a plan file, or the groups a planner may use (exactly one of them)."""

    plan: str | None = None
    """A plan file (relative to the job file) for the model on the cluster."""
    groups: list[str] | None = None
    """The groups the planner makes a plan on (every device of each)."""

    def _check(self, path: str, problems: Problems) -> None:
        if (self.plan is None) == (self.groups is None):
            problems.add(path, "give exactly one of 'plan' and 'groups'",
                         "write actor: {plan: actor-plan.yaml} or actor: {groups: [fast]}")
        if self.groups is not None and not self.groups:
            problems.add(join_path(path, "groups"), "the list is empty", "name at least one group of the cluster")


@dataclass(frozen=True)
class RolloutPlacement:
    """Where completions are generated: each ``tp`` devices of the groups hold one whole copy of the model."""

    groups: list[str]
    tp: int = 1
    """Devices (of one node) that hold one copy, its layers split tensor-parallel (1: a whole copy each)."""

    def _check(self, path: str, problems: Problems) -> None:
        if not self.groups:
            problems.add(join_path(path, "groups"), "the list is empty", "name at least one group of the cluster")
        if self.tp < 1:
            problems.add(join_path(path, "tp"), f"must be >= 1, got {self.tp}", "1 for a whole copy per device")


@dataclass(frozen=True)
class Placement:
    """collocated: rollout and actor time-share the actor's devices. disaggregated: rollout on devices
    of its own. auto: the predictor chooses between them."""

    actor: ActorPlacement
    mode: Literal["collocated", "disaggregated", "auto"] = "collocated"
    rollout: RolloutPlacement | None = None
    """Collocated: optional (default: the actor's groups). Disaggregated and auto: required."""

    def _check(self, path: str, problems: Problems) -> None:
        if self.rollout is None and self.mode != "collocated":
            problems.add(join_path(path, "rollout"), f"mode {self.mode} needs the rollout's groups",
                         "add rollout: {groups: [GROUP, ...]}")


@dataclass(frozen=True)
class RLJob:
    """An RL post-training job (GRPO). File fields first; the fields below them are filled by
    :func:`load_rl_job` (paths made absolute, the files they name loaded and checked)."""

    model: str
    """The model file."""
    prompts: str
    """Training prompts: JSON lines ``{"prompt": str, ...}``; other fields go to the reward."""
    reward: str
    """``FILE.py:function`` or ``package.module:function``: ``reward(prompt, completion, **fields) -> float``."""
    placement: Placement
    algorithm: Literal["grpo"] = "grpo"
    load: str | None = None
    """A ``--save`` checkpoint directory or ``hf:DIR``; default: random initial weights."""
    tokenizer: str = "bytes"
    """``bytes`` (UTF-8 bytes as ids) or a Hugging Face tokenizer path."""
    eval_prompts: str | None = None
    """Held-out prompts, decoded greedily before the first step and after the last."""
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8
    """Completions per prompt; advantages are normalised within each group (>= 2)."""
    max_new_tokens: int = 64
    stop: str | None = None
    """A completion ends after this string (or at the end token, or after max_new_tokens)."""
    temperature: float = 1.0
    lr: float = 1e-6
    clip: float = 0.2
    """Ratio clip epsilon."""
    kl_coef: float = 0.0
    """> 0: a k3 KL penalty to the initial policy, held by a frozen reference copy."""
    staleness: int = 0
    """0: every sample comes from the current weights; k: rollout may run up to k versions ahead."""
    seed: int = 0

    # --- filled by load_rl_job ---
    source: str = _derived("<dict>")
    """The job file."""
    model_spec: object = _derived()
    """The loaded :class:`~hetero.specs.model.ModelSpec`, with ``attention: fused`` (the runtime's SDPA)."""
    actor_plan: object = _derived()
    """The loaded actor :class:`~hetero.specs.plan.Plan` (None when ``placement.actor`` gives groups)."""
    prompt_records: tuple = _derived(())
    """The training prompts, :class:`~hetero.rl.prompts.PromptRecord` each (file line kept)."""
    eval_records: tuple = _derived(())
    """The eval prompts (empty without ``eval_prompts``)."""
    prompt_lengths: tuple = _derived(())
    """Tokens of each training prompt in the job's tokenizer, special ones included, as the run
    encodes it (the bytes tokenizer: its UTF-8 bytes)."""
    reward_ref: object = _derived()
    """The :class:`~hetero.rl.rewards.RewardRef` (imported once while loading: it imports)."""

    def _check(self, path: str, problems: Problems) -> None:
        for name, least, what in (("steps", 1, "RL steps to run, e.g. 100"),
                                  ("prompts_per_step", 1, "prompts sampled per step, e.g. 16"),
                                  ("group_size", 2, "completions per prompt, e.g. 8: advantages compare the "
                                                    "completions of a prompt, so one alone has none"),
                                  ("max_new_tokens", 1, "the longest completion in tokens, e.g. 64"),
                                  ("staleness", 0, "0 (on-policy) or the policy versions rollout may run ahead")):
            if getattr(self, name) < least:
                problems.add(name, f"must be >= {least}, got {getattr(self, name)}", what)
        for name, what in (("temperature", "the sampling temperature, e.g. 1.0 (GRPO needs different "
                                           "completions per prompt: greedy decoding gives one)"),
                           ("lr", "the learning rate, e.g. 1e-6"),
                           ("clip", "the ratio clip, e.g. 0.2")):
            if not getattr(self, name) > 0:
                problems.add(name, f"must be > 0, got {getattr(self, name):g}", what)
        if self.kl_coef < 0:
            problems.add("kl_coef", f"must be >= 0, got {self.kl_coef:g}", "0 for no KL penalty, e.g. 0.04")
        if self.stop == "":
            problems.add("stop", "is empty", "give the string that ends a completion, e.g. \"\\n\", or drop it")

    def replace(self, **changes) -> RLJob:
        """A copy with file fields changed (``steps=5``), keeping what :func:`load_rl_job` filled in."""
        new = dataclasses.replace(self, **changes)
        for f in dataclasses.fields(self):
            if not f.init:
                object.__setattr__(new, f.name, getattr(self, f.name))
        return new

    # --- what the runtime asks ---
    @property
    def samples_per_step(self) -> int:
        """Completions trained on per step: prompts_per_step x group_size."""
        return self.prompts_per_step * self.group_size

    @property
    def actor_groups(self) -> list[str]:
        """The groups the actor trains on (the plan's, in order of first use)."""
        if self.placement.actor.groups is not None:
            return list(self.placement.actor.groups)
        plan = self.actor_plan
        return list(plan.devices_by_group()) if plan is not None else []

    @property
    def rollout_groups(self) -> list[str]:
        """The groups that generate (collocated without a rollout entry: the actor's)."""
        if self.placement.rollout is not None:
            return list(self.placement.rollout.groups)
        return self.actor_groups

    @property
    def rollout_tp(self) -> int:
        return self.placement.rollout.tp if self.placement.rollout is not None else 1

    def placement_dict(self) -> dict:
        """The run summary's ``placement``: ``{"mode", "actor": {"groups", "plan"}, "rollout": {"groups"}}``."""
        plan = self.actor_plan.to_dict() if self.actor_plan is not None else {}
        rollout = {"groups": self.rollout_groups}
        if self.rollout_tp != 1:
            rollout["tp"] = self.rollout_tp
        return {"mode": self.placement.mode, "actor": {"groups": self.actor_groups, "plan": plan}, "rollout": rollout}


CHECKPOINT_MARKERS = (".metadata", "latest")
"""Files a ``--save`` checkpoint directory holds (native: DCP's .metadata; DeepSpeed: latest)."""

MAX_SHOWN = 5
"""Prompts shown per kind of problem (a file with one mistake on every line needs no more)."""


def load_rl_job(path_or_dict, cluster=None, source: str | None = None, base_dir: str | None = None) -> RLJob:
    """Load and check an RL job file (a path, or a dict with ``base_dir`` for its relative paths);
    with ``cluster`` (a loaded :class:`~hetero.specs.cluster.Cluster`) also check the placement on
    it. Raises :class:`~hetero.specs.errors.SpecError` listing every problem."""
    data, source = read_mapping(path_or_dict, "RL job", source)
    if base_dir is None:
        base_dir = os.path.dirname(os.path.abspath(source)) if not isinstance(path_or_dict, dict) else os.getcwd()
    problems = Problems(source=source)
    job = load_dataclass(RLJob, data, "", problems)
    if is_missing(job):   # an unknown field or a wrong type: what the file means is not known
        problems.raise_if_any()
    ranges_ok = not problems.blocking()   # a value out of range: the files are still checked
    resolve = _Resolver(base_dir, problems)
    updates = {"source": source}
    for name in ("model", "prompts", "eval_prompts"):
        updates[name] = resolve.path(name, getattr(job, name))
    updates["load"] = resolve.load(job.load)
    if job.tokenizer != "bytes":
        updates["tokenizer"] = resolve.path("tokenizer", job.tokenizer, kind="any")
    extra: list[Problem] = []
    model = _attempt(extra, _load_model, updates["model"]) if updates["model"] else None
    if model is not None and job.tokenizer == "bytes" and model.vocab_size < 256:
        problems.add("tokenizer", f"the bytes tokenizer needs vocab_size >= 256; the model has {model.vocab_size}",
                     "set vocab_size: 256 (or more) in the model file, or give a Hugging Face tokenizer")
    records = {}
    for name in ("prompts", "eval_prompts"):
        records[name] = tuple(read_prompts(updates[name], name, problems, name)) if updates[name] else ()
    tokenizer = updates.get("tokenizer", job.tokenizer)   # None: a tokenizer path not found (said)
    lengths = _check_lengths(records, job, model, tokenizer, problems) if model is not None and tokenizer else {}
    reward_ref = _check_reward(job.reward, base_dir, problems)
    plan = _check_placement(job, resolve, model, cluster, problems, extra)
    for name, value in updates.items():
        object.__setattr__(job, name, value)
    object.__setattr__(job, "model_spec", model)
    object.__setattr__(job, "actor_plan", plan)
    object.__setattr__(job, "prompt_records", records["prompts"])
    object.__setattr__(job, "eval_records", records["eval_prompts"])
    object.__setattr__(job, "prompt_lengths", tuple(lengths.get("prompts", ())))
    object.__setattr__(job, "reward_ref", reward_ref)
    if plan is not None and plan.global_batch_size != job.samples_per_step:
        problems.add("placement.actor.plan", f"the plan trains global_batch_size={plan.global_batch_size} samples "
                     f"a step; the job makes prompts_per_step x group_size = {job.prompts_per_step} x "
                     f"{job.group_size} = {job.samples_per_step}",
                     "make them equal (change the plan's batch, or prompts_per_step / group_size)")
    if cluster is not None and ranges_ok and not problems.blocking() and not extra:
        _check_fit(job, cluster, problems)
    if problems.items or extra:
        raise SpecError(problems.items + extra)
    return job


class _Resolver:
    """Paths of the job file made absolute against its folder; a missing one is a problem."""

    def __init__(self, base_dir: str, problems: Problems):
        self.base_dir, self.problems = base_dir, problems

    def path(self, field: str, value: str | None, kind: str = "file") -> str | None:
        if value is None:
            return None
        full = os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(value)))
        if not os.path.exists(full):
            self.problems.add(field, f"{full}: not found", "give a path relative to the job file's folder")
            return None
        if kind == "file" and not os.path.isfile(full):
            self.problems.add(field, f"{full} is not a file", "give the path of the file")
            return None
        return full

    def load(self, value: str | None) -> str | None:
        """``load``: a checkpoint directory, or ``hf:DIR`` (a Hugging Face model folder)."""
        if value is None:
            return None
        from hetero.hf import HF_PREFIX, hf_dir_of

        hf = hf_dir_of(value)
        full = self.path("load", hf if hf is not None else value, kind="dir")
        if full is None:
            return None
        bad = load_problem(full, hf is not None)
        if bad:
            self.problems.add("load", *bad)
            return None
        return HF_PREFIX + full if hf is not None else full


def load_problem(path: str, hf: bool) -> tuple[str, str] | None:
    """``(message, fix)`` when the existing ``path`` is no checkpoint directory (``hf``: no Hugging
    Face model folder), else None."""
    if not os.path.isdir(path):
        return f"{path} is a file, not a directory", "give a checkpoint directory written by --save, or hf:DIR"
    if hf:
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"{path} has no config.json", "give a Hugging Face model folder after hf:"
    elif not any(os.path.exists(os.path.join(path, m)) for m in CHECKPOINT_MARKERS):
        return (f"{path} is not a checkpoint (no .metadata)",
                "give a directory written by hetero launch --save or hetero rl --save, or hf:DIR")
    return None


def check_load(value: str, flag: str) -> str:
    """A ``--load`` argument (a checkpoint directory or ``hf:DIR``) checked and made absolute;
    raises :class:`~hetero.errors.HeteroError` naming ``flag`` when it is neither."""
    from hetero.errors import HeteroError
    from hetero.hf import HF_PREFIX, hf_dir_of

    hf = hf_dir_of(value)
    full = os.path.abspath(hf if hf is not None else value)
    bad = (f"{full}: not found", "give a checkpoint directory written by --save, or hf:DIR") \
        if not os.path.exists(full) else load_problem(full, hf is not None)
    if bad:
        raise HeteroError(f"{flag} {value}: {bad[0]} (fix: {bad[1]})")
    return HF_PREFIX + full if hf is not None else full


def _attempt(extra: list, load, *args):
    """``load(*args)``, or None with its problems (each named in its own file) added to ``extra``."""
    try:
        return load(*args)
    except SpecError as e:
        extra.extend(e.problems)
        return None


def _load_model(path: str):
    """The model as ``hetero rl`` runs it: its actor trains and its rollout generates on hetero's
    runtime, whose attention is one fused kernel (torch's scaled_dot_product_attention), whatever
    ``attention`` the file gives for other engines; the predictor prices it that way."""
    import dataclasses

    from hetero.specs.model import load_model

    return dataclasses.replace(load_model(path), attention="fused")


def _check_lengths(records: dict, job: RLJob, model, tokenizer: str, problems: Problems) -> dict[str, list[int]]:
    """Every prompt, counted in ``tokenizer``'s tokens as the run encodes it (special tokens
    included; the bytes tokenizer: its UTF-8 bytes), and max_new_tokens must fit the model's
    seq_length. Returns each prompts file's token counts (empty where they cannot be counted)."""
    from hetero.errors import HeteroError
    from hetero.tokenizer import load_text_tokenizer

    room = model.seq_length - job.max_new_tokens
    if room < 1:
        problems.add("max_new_tokens", f"{job.max_new_tokens} leaves no room for a prompt in the model's "
                                       f"seq_length {model.seq_length}", f"give at most {model.seq_length - 1}")
        return {}
    if tokenizer == "bytes" and model.vocab_size < 256:
        return {}   # said above
    try:
        tok = load_text_tokenizer(tokenizer, model.vocab_size)
    except HeteroError as e:
        _add_error(problems, "tokenizer", e)
        return {}
    counts = {}
    for name, recs in records.items():
        counts[name] = [len(tok.encode(r.prompt, special=True)) for r in recs]
        long = [(r, n) for r, n in zip(recs, counts[name]) if n > room]
        for r, n in long[:MAX_SHOWN]:
            problems.add(name, f"{r.where()}: the prompt is {n} tokens; with "
                               f"max_new_tokens {job.max_new_tokens} at most {room} fit the model's seq_length "
                               f"{model.seq_length}", "shorten the prompt, lower max_new_tokens or raise seq_length")
        if len(long) > MAX_SHOWN:
            problems.add(name, f"... and {len(long) - MAX_SHOWN} more prompts too long", "")
    return counts


def _add_error(problems: Problems, field: str, error) -> None:
    """A one-line error (``message (fix: ...)``) as ``field``'s problem, its fix apart."""
    message, _, fix = str(error).rpartition(" (fix: ")
    problems.add(field, message or str(error), fix.rstrip(")"))


def _check_reward(spec: str, base_dir: str, problems: Problems):
    from .rewards import RewardError, load_reward, parse_reward_ref

    try:
        ref = parse_reward_ref(spec, base_dir)
        load_reward(ref)
        return ref
    except RewardError as e:
        _add_error(problems, "reward", e)
        return None


def _check_placement(job: RLJob, resolve: _Resolver, model, cluster, problems: Problems, extra: list):
    """The actor plan (loaded and checked against the model, and the cluster when given) and the
    groups named; returns the plan or None."""
    placement = job.placement
    names = cluster.group_names if cluster is not None else None
    if names is not None:
        named = [("placement.actor.groups", g) for g in placement.actor.groups or ()]
        named += [("placement.rollout.groups", g) for g in (placement.rollout.groups if placement.rollout else ())]
        for where, g in named:
            if g not in names:
                problems.add(where, f"unknown group '{g}' (the cluster {cluster.name} has {', '.join(names)})",
                             did_you_mean(g, names))
    if placement.rollout is not None and model is not None and model.num_attention_heads % placement.rollout.tp:
        problems.add("placement.rollout.tp", f"{placement.rollout.tp} does not divide the model's "
                                             f"{model.num_attention_heads} attention heads", "use a divisor of the head count")
    plan = None
    if placement.actor.plan is not None:
        path = resolve.path("placement.actor.plan", placement.actor.plan)
        if path is not None and model is not None:
            from hetero.specs.plan import check_plan_model, load_plan

            plan = _attempt(extra, load_plan, path, cluster, model)
            if plan is not None and cluster is None:
                _attempt(extra, check_plan_model, plan, model, path)
    if placement.mode == "collocated" and placement.rollout is not None:
        actor = set(placement.actor.groups or (plan.devices_by_group() if plan else ()))
        outside = [g for g in placement.rollout.groups if actor and g not in actor]
        if outside:
            problems.add("placement.rollout.groups", f"collocated rollout runs on the actor's devices, and "
                         f"{', '.join(outside)} is not among the actor's groups ({', '.join(sorted(actor))})",
                         "name the actor's groups, drop rollout, or use mode: disaggregated")
    return plan


def _check_fit(job: RLJob, cluster, problems: Problems) -> None:
    """Disaggregated: the rollout needs devices the actor does not use, at least ``tp`` per group it
    names (within one node for tp > 1)."""
    placement = job.placement
    if placement.mode != "disaggregated":
        return
    if placement.actor.groups is not None:
        used = {g: cluster.group(g).num_devices for g in placement.actor.groups}
    else:
        used = job.actor_plan.devices_by_group() if job.actor_plan is not None else {}
    tp = placement.rollout.tp
    for g in placement.rollout.groups:
        group = cluster.group(g)
        free = group.num_devices - used.get(g, 0)
        if tp > group.devices_per_node:
            problems.add("placement.rollout.tp", f"tp {tp} is more than the {group.devices_per_node} devices of a "
                                                 f"node of group {g}", "tensor parallelism stays within one node")
        elif free < tp:
            problems.add("placement.rollout.groups",
                         f"group {g} has {group.num_devices} devices and the actor uses {used.get(g, 0)}: "
                         f"{free} left for the rollout, which needs {tp} a copy",
                         "give the rollout groups the actor does not use, or use mode: collocated")


def looks_like_rl_job(data: dict) -> bool:
    """Whether a parsed YAML mapping is an RL job file (for ``hetero validate``)."""
    return "reward" in data and ("prompts" in data or "placement" in data)
