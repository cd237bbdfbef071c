"""Reward functions: user Python named ``FILE.py:function`` (relative to the job file) or
``package.module:function``, called as ``reward(prompt, completion, **fields) -> float`` in worker
processes.

A job's reward is imported once in the process that loads the job (so a reward that does not import
is an error of the job file, named before anything runs) and once in each worker of the run's
:class:`RewardPool` (spawned processes: they share no state with the trainer, and a reward that
leaks memory or crashes does not take a training rank with it). Each process imports it once
(:func:`load_reward` keeps what it imported).

A reward that raises, returns a non-number (``bool`` included) or a non-finite number ends the run
with one line (:class:`RewardError`) naming the function, the prompt's file and line and what it
returned or raised.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from dataclasses import dataclass

from hetero.errors import HeteroError, clip

from .prompts import PromptRecord


class RewardError(HeteroError):
    """A reward function that cannot be imported, or failed on a completion: one line."""


@dataclass(frozen=True)
class RewardRef:
    """Where a reward function lives: a file (``path`` absolute) or a module, and its name."""

    spec: str
    """As the job file wrote it (``rewards.py:exact``)."""
    function: str
    path: str | None = None
    """The file's absolute path (``FILE.py:function``), else None."""
    module: str | None = None
    """The module's dotted name (``package.module:function``), else None."""

    @property
    def name(self) -> str:
        return self.spec


def parse_reward_ref(spec: str, base_dir: str) -> RewardRef:
    """Split ``FILE.py:function`` (``FILE`` relative to ``base_dir``, the job file's folder) or
    ``package.module:function``; a malformed spec raises :class:`RewardError`."""
    where, sep, function = spec.rpartition(":")
    if not sep or not where or not function.isidentifier():
        raise RewardError(f"'{spec}' is not FILE.py:function or package.module:function "
                          f"(fix: name the file or module and the function, e.g. rewards.py:exact)")
    if where.endswith(".py") or os.sep in where or "/" in where:
        return RewardRef(spec, function, path=os.path.abspath(os.path.join(base_dir, where)))
    if not all(part.isidentifier() for part in where.split(".")):
        raise RewardError(f"'{where}' is neither a .py file nor a module name (fix: write FILE.py:function "
                          f"or package.module:function)")
    return RewardRef(spec, function, module=where)


_LOADED: dict[RewardRef, object] = {}


def load_reward(ref: RewardRef):
    """The reward function of ``ref``, imported in this process the first time and kept; an import
    that fails (missing file or module, an error while the file runs, no such function, not
    callable) raises :class:`RewardError` naming the reward and the cause."""
    if ref in _LOADED:
        return _LOADED[ref]
    if ref.path is not None:
        if not os.path.isfile(ref.path):
            raise RewardError(f"reward {ref.name}: file {ref.path} not found (fix: give the path of the reward's "
                              f".py file, relative to the job file)")
        # a private module name per file, so two jobs' rewards.py do not replace each other in sys.modules
        digest = hashlib.sha1(ref.path.encode()).hexdigest()[:10]
        name = f"hetero_reward_{digest}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, ref.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module   # before running it: dataclasses and pickling look themselves up
            try:
                spec.loader.exec_module(module)
            except BaseException as e:   # noqa: BLE001 - user code: any failure is the reward's problem
                del sys.modules[name]
                raise RewardError(f"reward {ref.name}: importing {ref.path} failed: {_describe(e)} "
                                  f"(fix: make the file run on its own: python {ref.path})") from None
    else:
        try:
            module = importlib.import_module(ref.module)
        except BaseException as e:   # noqa: BLE001
            raise RewardError(f"reward {ref.name}: cannot import module {ref.module}: {_describe(e)} (fix: "
                              f"install the package, or name a file FILE.py:function)") from None
    function = getattr(module, ref.function, None)
    if function is None:
        raise RewardError(f"reward {ref.name}: no function '{ref.function}' in {ref.path or ref.module} "
                          f"(fix: name a function defined there)")
    if not callable(function):
        raise RewardError(f"reward {ref.name}: '{ref.function}' is a {type(function).__name__}, not a function "
                          f"(fix: name a function reward(prompt, completion, **fields) -> float)")
    _LOADED[ref] = function
    return function


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return clip(text, 300)


def check_value(value) -> str | None:
    """Why ``value`` is no reward (not a real number, a bool, not finite), or None when it is one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"returned {clip(repr(value), 120)} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {float(value)!r}, not a finite number"
    return None


def call_reward(function, prompt: str, completion: str, fields: dict) -> tuple[bool, float | str]:
    """``(True, reward)`` or ``(False, what went wrong)``: one call, never raising."""
    try:
        value = function(prompt, completion, **fields)
    except (Exception, SystemExit) as e:   # noqa: BLE001 - user code (sys.exit too: it must not end a worker)
        return False, f"raised {_describe(e)}"
    problem = check_value(value)
    return (False, problem) if problem else (True, float(value))


# --- the worker processes -------------------------------------------------------------------------

_WORKER_FUNCTION = None


def _worker_init(ref: RewardRef) -> None:
    global _WORKER_FUNCTION
    try:
        _WORKER_FUNCTION = load_reward(ref)
    except RewardError as e:
        _WORKER_FUNCTION = e   # reported with the first call, where the parent can say it in one line


def _worker_call(item: tuple[str, str, dict]) -> tuple[bool, float | str]:
    if isinstance(_WORKER_FUNCTION, RewardError):
        return False, f"could not be imported in a reward worker: {_WORKER_FUNCTION}"
    return call_reward(_WORKER_FUNCTION, *item)


class RewardPool:
    """The run's reward workers: started once (``spawn``: safe in a process that already runs torch
    threads), each importing the reward once; :meth:`score` maps a batch of completions to rewards in
    order. ``workers=0`` calls the reward in this process (tests, debugging). Use as a context
    manager, or call :meth:`close`."""

    def __init__(self, ref: RewardRef, workers: int = 2, timeout_s: float = 60.0):
        self.ref, self.timeout_s = ref, timeout_s
        self._pool = None
        if workers <= 0:
            self._function = load_reward(ref)
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # an executor, not multiprocessing.Pool: a worker that dies (os._exit, a crash in native code)
            # breaks it at once, where a Pool would replace the worker and wait for the lost call forever
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_init, initargs=(ref,))
            self._workers = workers

    def score(self, records: list[PromptRecord], completions: list[str]) -> list[float]:
        """``reward(record.prompt, completion, **record.fields)`` for each pair, in order. The first
        failure (in order) raises :class:`RewardError` naming the function, the prompt's file and
        line and what it returned or raised; a call that takes longer than ``timeout_s`` too."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} prompts for {len(completions)} completions")
        items = [(r.prompt, c, r.fields) for r, c in zip(records, completions)]
        if self._pool is None:
            results = [call_reward(self._function, *item) for item in items]
        else:
            from concurrent.futures import TimeoutError as FuturesTimeout
            from concurrent.futures.process import BrokenProcessPool

            try:
                results = list(self._pool.map(_worker_call, items, timeout=self.timeout_s,
                                              chunksize=max(1, len(items) // (4 * self._workers))))
            except FuturesTimeout:
                self.close()
                raise RewardError(f"reward {self.ref.name}: a batch of {len(items)} calls took more than "
                                  f"{self.timeout_s:g} s (fix: make the reward faster, or look for a loop that "
                                  f"does not end)") from None
            except BrokenProcessPool:
                self.close()
                raise RewardError(f"reward {self.ref.name}: a reward worker process died while scoring a batch of "
                                  f"{len(items)} completions (os._exit, a signal or a crash in native code) "
                                  f"(fix: run the reward on these prompts in a plain python process to see it)") from None
        rewards = []
        for record, completion, (ok, value) in zip(records, completions, results):
            if not ok:
                raise RewardError(f"reward {self.ref.name} on {record.where()} (completion "
                                  f"{clip(repr(completion), 80)}) {value}")
            rewards.append(value)
        return rewards

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:   # a call still running (a reward in an endless loop) is not waited for
                if p.is_alive():
                    p.terminate()
            for p in processes:
                p.join(5)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
