"""The run configuration: everything about a run that is not the cluster, model or plan.

:class:`RunOptions` is the one validated object every way of starting a run builds: ``hetero launch``
(its flags), :func:`hetero.runtime.launch` (its keyword arguments) and every worker (from the run
file). Each field carries its meaning in a docstring, grouped under short banners; ``hetero launch
--help`` shows the same text (:func:`option_help`). Construction checks every value and raises one
:class:`OptionsError` listing each problem with its field and fix, so a run with ``steps=0, lr=-1``
hears of both at once, before any process starts.
"""
from __future__ import annotations

import ast
import functools
import inspect
import math
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Literal

from hetero.runtime.lr_schedule import ScheduleName
from hetero.specs.errors import Problem, SpecError

EngineName = Literal["native", "deepspeed"]
AllocatorName = Literal["caching", "planned"]
ENGINES: tuple[str, ...] = typing.get_args(EngineName)
ALLOCATORS: tuple[str, ...] = typing.get_args(AllocatorName)


@dataclass
class RunOptions:
    """Everything about a run that is not the cluster, model or plan; checked on construction."""

    # --- length and randomness ---
    steps: int = 5
    """Training steps (default 5)."""
    seed: int = 0
    """Seed of the initial weights and the synthetic token stream (default 0)."""

    # --- data ---
    data: str | None = None
    """Tokens (.npy, .bin uint16, .int32.bin), prompt/completion lines (.jsonl: the loss on the completions'
    tokens only) or text (byte tokens); unset: the seeded synthetic stream."""
    tokenizer: str | None = None
    """With a .jsonl data file: the Hugging Face tokenizer (a model folder or its tokenizer.json) of the
    prompts and completions; unset: their UTF-8 bytes as ids (vocab_size >= 256)."""

    # --- schedule and optimizer ---
    lr: float = 1e-3
    """AdamW learning rate (default 1e-3): the peak rate of the schedule."""
    lr_schedule: ScheduleName = "constant"
    """How the learning rate moves over the run's steps after the warm-up: constant (default), cosine or
    linear decay from lr to min_lr, reached at the last step (:mod:`hetero.runtime.lr_schedule`)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr before the schedule (step k of the warm-up applies lr * k / N;
    default 0: none)."""
    min_lr: float = 0.0
    """The floor the cosine and linear schedules decay to at the last step (default 0; at most lr)."""
    weight_decay: float = 0.0
    """AdamW weight decay (default 0)."""
    clip: float = 1.0
    """Global gradient-norm clip (default 1; 0: off)."""
    loss_scale: float | None = None
    """fp16 models: the initial dynamic loss scale (unset: 65536; halved and the step skipped on a gradient
    overflow, doubled after 2000 clean steps; :mod:`hetero.runtime.loss_scale`)."""

    # --- engine and execution ---
    engine: EngineName = "native"
    """native: hetero's pipeline / tp / dp engine with holder-set gradient sums (default); deepspeed:
    DeepSpeed ZeRO for one-stage tp1 plans (CPU accelerator)."""
    threads: int = 1
    """torch intra-op threads per worker (default 1)."""
    overlap: bool = True
    """Native engine: reduce each bucket of gradients as soon as the step's last backward has finished it,
    under the rest of the backward (:mod:`hetero.runtime.overlap`); off (``--no-overlap``): every bucket
    after the schedule, for comparison."""
    compile: bool | None = None
    """Native engine: ``torch.compile`` each transformer block (:func:`hetero.runtime.model.compile_blocks`);
    unset: on for CUDA / ROCm / Ascend ranks, off for CPU ranks, where compiling takes minutes on few cores."""
    bucket_mb: float = 25.0
    """Native engine: the largest bucket of gradients one collective sums, in MB of fp32 (default 25, as DDP)."""
    allocator: AllocatorName = "caching"
    """caching: PyTorch's default allocator; planned: each rank records two steps, then serves its step's
    memory plan from one arena (:mod:`hetero.memplan.serve`, docs/memory-planning.md)."""

    # --- checkpoints ---
    save: str | None = None
    """Directory for a torch.distributed.checkpoint written at the end of the run."""
    load: str | None = None
    """Checkpoint directory to start from (any plan of the same model), or the Hugging Face model folder
    of hf:DIR (each rank reads its shards)."""

    # --- failures and elasticity ---
    timeout_s: float = 60.0
    """Communicator timeout in seconds: a silent peer ends the job with an error naming it (default 60)."""
    inject_failure: tuple[int, int] | None = None
    """(STEP, RANK): that rank exits at the start of that (1-based) step, to test failure handling."""
    elastic: bool = False
    """When a device leaves (its rank dies or ``inject_failure`` ends it), the survivors hand off their live
    state (:mod:`hetero.runtime.handoff`), the planner replans on the remaining devices with the same global
    batch, and training goes on from that step (:mod:`hetero.runtime.elastic`); devices join or leave on
    purpose by editing the cluster file while the run trains (the ranks pause at a step boundary and go on
    under a new plan). Native engine; one machine launching every node slot, or one ``--node-rank`` call per
    machine (a lost worker or machine survived, machines join: docs/elastic.md); with ZeRO only the deliberate
    changes (a failure ends the run)."""
    machine_lost_after_s: float = 2.0
    """Elastic runs over several machines: a machine whose launcher's heartbeat (every 0.2 s) has stood still
    this many seconds is lost, its workers with it (default 2; at least 0.5). Shorter: a lost machine's
    downtime is shorter; too short: a machine slowed past it (swapping, a long pause) is taken for lost."""

    # --- outputs ---
    summary: str | None = None
    """Where rank 0 writes the run summary (JSON, docs/formats.md); unset: no summary file."""
    trace: str | None = None
    """Where rank 0 writes a Chrome / Perfetto trace of forward / backward events; unset: no trace."""
    quiet: bool = False
    """No report from rank 0 (header, per-step lines, tables); errors still print."""

    # --- plumbing between the launcher and its workers ---
    run_dir: str = ""
    """Where workers leave pid / ready / done / error files for the launcher, kept after the run (unset: a
    temporary directory, removed when the run ends; a dry run keeps it for its commands)."""
    extra: list[str] = field(default_factory=list)
    """Arguments passed on to every worker."""

    def __post_init__(self) -> None:
        problems = option_problems(self)
        if problems:
            raise OptionsError(problems)


@dataclass(frozen=True)
class OptionProblem(Problem):
    """A :class:`~hetero.specs.errors.Problem` of one run option: ``path`` is the field's name and
    ``value`` the value given."""

    value: object = None

    def __str__(self) -> str:
        text = f"{self.source}: {self.path}={self.value!r}: {self.message}"
        return text + (f" (fix: {self.fix})" if self.fix else "")

    def as_flag(self, flag: str, given: object) -> Problem:
        """The same problem said of a command-line flag: ``--lr -1.0: out of range (fix: ...)``."""
        return Problem("", self.message, self.fix, f"{flag} {given}")


class OptionsError(SpecError):
    """Bad run options: every :class:`OptionProblem` found, one per line."""


def _finite(low: float, strict: bool):
    def ok(v) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v) and (v > low if strict else v >= low)
    return ok


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_RANGES = (   # field, whether the value is in range, fix
    ("steps", _count, "give at least 1 step, e.g. 5"),
    ("timeout_s", _finite(0, True), "give seconds > 0, e.g. 60"),
    ("machine_lost_after_s", _finite(0.5, False), "give seconds >= 0.5 (2.5 heartbeats), e.g. 2"),
    ("lr", _finite(0, True), "give a positive learning rate, e.g. 1e-3"),
    ("warmup_steps", lambda v: _is_int(v) and v >= 0, "give a number of steps >= 0 (0: no warm-up)"),
    ("min_lr", _finite(0, False), "give a learning rate >= 0, at most lr"),
    ("weight_decay", _finite(0, False), "give a number >= 0"),
    ("clip", _finite(0, False), "give a norm >= 0 (0: no clipping)"),
    ("loss_scale", lambda v: v is None or _finite(0, True)(v), "give a positive number, e.g. 65536"),
    ("threads", _count, "give at least 1 thread per worker"),
    ("bucket_mb", _finite(0, True), "give megabytes > 0, e.g. 25"),
)


def option_problems(options: RunOptions) -> list[OptionProblem]:
    """Every problem of ``options``, in field order (empty: all good)."""
    out = []

    def add(name: str, message: str, fix: str) -> None:
        out.append(OptionProblem(name, message, fix, "run options", getattr(options, name)))

    for name, ok, fix in _RANGES:
        value = getattr(options, name)
        if not ok(value):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            add(name, "out of range" if number else "not a number", fix)
    for name in ("engine", "allocator", "lr_schedule"):
        allowed = typing.get_args(_hints()[name])
        if getattr(options, name) not in allowed:
            add(name, "unknown", f"one of {', '.join(allowed)}")
    if _finite(0, False)(options.min_lr) and _finite(0, True)(options.lr):
        if options.min_lr > options.lr:
            add("min_lr", f"above lr {options.lr:g}: the decay would raise the rate",
                f"give a floor of at most lr, e.g. {options.lr / 10:g}")
        elif options.min_lr > 0 and options.lr_schedule == "constant":
            add("min_lr", "set with the constant schedule, which never decays to it",
                "add --lr-schedule cosine or linear, or leave min_lr out")
    failure = options.inject_failure
    if failure is not None:
        if not (isinstance(failure, tuple) and len(failure) == 2 and all(_is_int(x) for x in failure)):
            add("inject_failure", "not a (step, rank) pair", "give STEP:RANK, e.g. 2:3")
        elif failure[0] < 1 or failure[1] < 0:
            add("inject_failure", "out of range", "STEP is 1-based and RANK >= 0, e.g. 2:3")
    return out


@functools.lru_cache(maxsize=None)
def _hints() -> dict:
    return typing.get_type_hints(RunOptions)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_failure(text: str | None) -> tuple[int, int] | None:
    """``--inject-failure STEP:RANK`` as a pair (its range is checked by :class:`RunOptions`); raises
    :class:`OptionsError` for text that is not two integers."""
    if not text:
        return None
    try:
        step, rank = text.split(":")
        return int(step), int(rank)
    except ValueError:
        raise OptionsError([OptionProblem("inject_failure", "expected STEP:RANK", "e.g. 2:3", "run options",
                                          text)]) from None


@functools.lru_cache(maxsize=None)
def field_docs() -> dict[str, str]:
    """Each :class:`RunOptions` field's docstring, read from this module's source (one line each,
    Sphinx roles and literals reduced to their text)."""
    tree = ast.parse(inspect.getsource(RunOptions))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            text = " ".join(after.value.value.split())
            text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")
            docs[node.target.id] = text
    return docs


def option_help(name: str, prefix: str = "") -> str:
    """The help text of the flag for field ``name``: its docstring (``%`` escaped for argparse)."""
    return (prefix + field_docs()[name]).replace("%", "%%")


def option_default(name: str):
    """The default of field ``name``: what the flag defaults to (one place for it)."""
    return next(f.default for f in fields(RunOptions) if f.name == name)


FIELDS = tuple(f.name for f in fields(RunOptions))
"""The field names, in order."""
