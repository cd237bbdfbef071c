"""Multi-process tests: ranks with a communicator, the check that a run leaves nothing behind, and
a stand-in for the coordinator's store.

Both build on ``tests/_spawn.py`` (one process per rank, a timeout, every process ended on the way
out); a test that starts processes is marked ``slow`` and has a timeout of its own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from _spawn import processes_naming, spawn

__all__ = ["leftover", "assert_no_leftover", "with_communicator", "DictStore"]


def leftover(run_dir: Path | str) -> list[int]:
    """The live processes (zombies aside) whose command line names ``run_dir``: a launch's node
    launchers and workers all carry their run directory (the run file lives there)."""
    return processes_naming(str(run_dir))


def _half_written(path: Path) -> list[Path]:
    """What an interrupted atomic write of ``path`` leaves beside it: ``PATH.partial`` (a staging
    folder), ``PATH.tmp`` / ``PATH.<pid>.tmp`` and ``.NAME.<random>.tmp`` (mkstemp's)."""
    parent, name = path.parent, path.name
    if not parent.is_dir():
        return []
    return sorted({*parent.glob(f"{name}.partial"), *parent.glob(f"{name}*.tmp"), *parent.glob(f".{name}.*.tmp")})


def assert_no_leftover(run_dir: Path | str | None = None, *, files: Iterable[Path | str] = ()) -> None:
    """Fail the test when a process of the run in ``run_dir`` is still alive (:func:`leftover`), or
    when one of ``files`` (outputs a failed command must not write) exists, whole or half-written."""
    if run_dir is not None:
        left = leftover(run_dir)
        assert not left, f"worker or launcher processes left behind: pids {left}"
    for path in map(Path, files):
        assert not path.exists(), f"{path} was written"
        assert not _half_written(path), f"half-written files left beside {path}: {_half_written(path)}"


def _communicator_rank(rank: int, world_size: int, fn: Callable[..., Any], vendors: list[str], bridge: str,
                       comm_timeout: float, args: tuple):
    import torch.distributed as dist

    from hetero.comm import Communicator

    dist.init_process_group("gloo")   # env://: _spawn set the rendezvous on 127.0.0.1
    comm = Communicator.from_vendors(vendors, bridge=bridge, timeout=comm_timeout)
    return fn(comm, *args)


def with_communicator(fn: Callable[..., Any], vendors: Sequence[str], args: Sequence[Any] = (), *,
                      bridge: str = "gloo", comm_timeout: float = 30.0, timeout: float = 120.0,
                      **spawn_options: Any) -> list[Any]:
    """Run ``fn(comm, *args)`` in one process per entry of ``vendors`` (rank r has vendor tag
    ``vendors[r]``), each after ``torch.distributed`` is initialised over Gloo and a
    :class:`hetero.comm.Communicator` is built from ``vendors`` (``bridge``, ``comm_timeout``: its
    own timeout for a collective); ``comm.rank`` and ``comm.world_size`` say which rank runs. Returns
    each rank's result, by rank.

    ``fn`` lives at module level (it is pickled to the ranks). ``timeout`` bounds the whole run: the
    ranks still running then are named in the :class:`_spawn.SpawnError`, and every rank is ended
    either way. Each rank's process exits right after ``fn`` returns, so ``fn`` closes the
    communicator only where closing is what it tests. ``spawn_options``: ``env``, ``may_die`` (see
    :func:`_spawn.spawn`)."""
    return spawn(_communicator_rank, len(vendors), args=(fn, list(vendors), bridge, comm_timeout, tuple(args)),
                 timeout=timeout, **spawn_options)


class DictStore(dict):
    """The part of a ``torch.distributed`` store a reconfiguration's helpers use (``set``, ``get``,
    ``check``), in one process's memory."""

    def set(self, key, value):
        self[key] = value

    def get(self, key):
        return self[key]

    def check(self, keys):
        return all(k in self for k in keys)
