"""Checkpoints with torch.distributed.checkpoint, addressable by layer and tensor name.

Keys are plan-independent: ``model/layers.<l>.<tensor>``, ``model/wte.weight``, ...,
``optim/<param>/exp_avg``, ``optim/<param>/exp_avg_sq``, ``optim/<param>/step``, ``meta/step``
and, for fp16 runs, ``meta/loss_scale``. Every tensor is stored unsharded, written once (by the lowest rank holding it; tp
shards are gathered first), so a run with a different plan (other layer splits, tp degrees,
pipeline shapes) loads exactly the tensors its ranks hold and shards them locally.
"""
from __future__ import annotations

import os
import pickle
import shutil

import torch
import torch.distributed.checkpoint as dcp

from hetero.errors import HeteroError
from hetero.runtime.grads import copy_full_into, full_tensor, shard_like

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                     ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only what a checkpoint's ``.metadata`` holds (DCP's metadata classes, torch sizes,
    dtypes and layouts, paths): any other global, e.g. ``os.system``, is refused before it can run."""

    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :class:`_MetadataUnpickler` (torch's reader calls
    plain ``pickle.load``, which runs whatever code the file names) and must describe tensors only
    (a non-tensor entry would be read back with ``torch.load(weights_only=False)``)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

        where = f"--load {self.path}"
        try:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise HeteroError(f"{where}: no checkpoint metadata (.metadata) there (fix: give a directory written "
                              f"by hetero launch --save that finished)") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
            raise HeteroError(f"{where}: unreadable or unsafe checkpoint metadata ({e}); refusing to load it "
                              f"(fix: load a checkpoint written by hetero launch --save)") from None
        if not isinstance(metadata, Metadata):
            raise HeteroError(f"{where}: the metadata is a {type(metadata).__name__}, not a checkpoint's "
                              f"(fix: load a checkpoint written by hetero launch --save)")
        odd = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
        if odd:
            raise HeteroError(f"{where}: entries {odd[:3]} are not tensors, which a checkpoint written by --save "
                              f"never holds; refusing to unpickle them (fix: load a checkpoint written by "
                              f"hetero launch --save)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def save_checkpoint(path: str, module, optimizer, holders: dict, rank: int, step: int,
                    loss_scale: float | None = None) -> None:
    """Write this rank's share of the plan-independent checkpoint (a collective: every rank calls it);
    ``loss_scale``: the fp16 dynamic loss scale to resume with."""
    state: dict[str, torch.Tensor] = {}
    # A ZeRO optimizer (hetero.runtime.zero) gathers its slices over every holder set first, the same
    # collectives in the same order on every rank, keeping host copies of the states this rank writes;
    # the tp gathers below follow.
    sharded = (optimizer.full_state(keep=lambda n: holders[n][0] == rank) if hasattr(optimizer, "full_state")
               else None)
    for name, p in module.named_parameters():
        owner = holders[name][0] == rank
        full = full_tensor(p.detach())  # collective inside the tp group: every tp rank takes part
        if sharded is not None:
            st = sharded.get(name, {})
            if "param" in st:   # the exact fp32 master of a parameter holding bf16-rounded values
                full = st["param"]
            moments = {k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st}
        else:
            st = optimizer.state.get(p, {})
            moments = {k: full_tensor(st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st}
        if owner:  # host copies: a checkpoint does not depend on where its writer computed
            state[f"model/{name}"] = full.to("cpu", copy=True)
            for k, v in moments.items():   # ZeRO's are host copies already
                state[f"optim/{name}/{k}"] = v if sharded is not None else v.to("cpu", copy=True)
            if "step" in st:
                state[f"optim/{name}/step"] = torch.as_tensor(st["step"], dtype=torch.float32).to("cpu", copy=True)
    for name, b in _kept_buffers(module):   # written by the lowest rank holding the layer
        if holders[_holder_param(module, name)][0] == rank:
            state[f"model/{name}"] = b.detach().to("cpu", copy=True)
    if rank == 0:
        state.update(_meta_entries(step, loss_scale))
    # Written beside ``path`` and moved into place when complete, so an interrupted save leaves the
    # previous checkpoint whole (not its .metadata next to half of the new files). No rank writes
    # before dcp.save's planning collective, which rank 0 joins after clearing a stale staging dir;
    # every rank's files are written when dcp.save returns on rank 0 (its final collective).
    staging = staging_dir(path)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dcp.save(state, checkpoint_id=staging)
    if rank == 0:
        put_in_place(staging, path)


def _meta_entries(step: int, loss_scale: float | None) -> dict[str, torch.Tensor]:
    """The run's own entries: the step to resume at and, for fp16, the loss scale."""
    out = {"meta/step": torch.tensor(step, dtype=torch.int64)}
    if loss_scale is not None:
        out["meta/loss_scale"] = torch.tensor(loss_scale, dtype=torch.float64)
    return out


def save_assembled_checkpoint(path: str, state: dict[str, torch.Tensor], step: int,
                              loss_scale: float | None) -> None:
    """Write full tensors keyed as :func:`save_checkpoint` keys them (``model/...``, ``optim/...``) as a
    checkpoint, from one process without a process group (an elastic handoff's assembled state)."""
    import warnings

    with warnings.catch_warnings():   # "no process group: saving as a single process" is the intent here
        warnings.simplefilter("ignore")
        dcp.save({**state, **_meta_entries(step, loss_scale)}, checkpoint_id=path, no_dist=True)


def staging_dir(path: str) -> str:
    """Where a checkpoint for ``path`` is written before it is moved into place."""
    from hetero.specs.io import staging_path

    return staging_path(path)


def put_in_place(staging: str, path: str) -> None:
    """Replace ``path`` (a previous checkpoint, or nothing) with the complete ``staging`` directory;
    a crash in between leaves the previous one as ``<path>.old``."""
    old = None
    if os.path.lexists(path):
        from hetero.specs.io import previous_path

        old = previous_path(path)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(staging, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def is_checkpoint_dir(path: str) -> bool:
    """An empty directory, or one a --save wrote (native: DCP's .metadata; DeepSpeed: its 'latest')."""
    names = set(os.listdir(path))
    return not names or ".metadata" in names or "latest" in names


def saved_loss_scale(path: str) -> float | None:
    """The fp16 loss scale stored in the checkpoint at ``path``, or None (fp32/bf16, older checkpoints)."""
    reader = SafeReader(path)
    if "meta/loss_scale" not in reader.read_metadata().state_dict_metadata:
        return None
    state = {"meta/loss_scale": torch.tensor(0.0, dtype=torch.float64)}
    dcp.load(state, storage_reader=reader)
    return float(state["meta/loss_scale"])


def load_checkpoint(path: str, module, optimizer, num_layers: int | None = None) -> int:
    """Fill this rank's parameters and AdamW state from ``path``; returns the step to resume at.
    ``num_layers``: the model's, checked against the checkpoint's (a rank sees only its own layers).
    ``optimizer`` None: the parameters alone (generation), the optimizer state not read."""
    reader = SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata
    available = set(saved) if optimizer is not None else {k for k in saved if not k.startswith("optim/")}
    state: dict[str, torch.Tensor] = {"meta/step": torch.tensor(0, dtype=torch.int64)}
    params = dict(module.named_parameters())
    check_same_model(path, saved, {name: tuple(_full_shape(p)) for name, p in params.items()}, num_layers)
    for name, p in params.items():
        shape = tuple(_full_shape(p))
        state[f"model/{name}"] = torch.empty(shape)
        for k in ("exp_avg", "exp_avg_sq"):
            if f"optim/{name}/{k}" in available:
                state[f"optim/{name}/{k}"] = torch.empty(shape)
        if f"optim/{name}/step" in available:
            state[f"optim/{name}/step"] = torch.tensor(0.0)
    buffers = {name: b for name, b in _kept_buffers(module) if f"model/{name}" in saved}   # absent: left as built
    for name, b in buffers.items():
        state[f"model/{name}"] = torch.empty(b.shape, dtype=b.dtype)
    dcp.load(state, storage_reader=reader)
    with torch.no_grad():
        for name, b in buffers.items():
            b.copy_(state[f"model/{name}"])
    sharded = getattr(optimizer, "load_full_state", None)   # ZeRO: takes its slices of the full states
    full_states = {}
    with torch.no_grad():
        for name, p in params.items():
            copy_full_into(p, state[f"model/{name}"])
            if f"optim/{name}/exp_avg" not in state:
                continue
            if sharded is not None:
                full_states[name] = {k: state[f"optim/{name}/{k}"] for k in ("exp_avg", "exp_avg_sq", "step")}
            else:
                optimizer.state[p] = {   # on the parameter's device, where the fused kernel wants its step
                    "step": state[f"optim/{name}/step"].to(p.device, copy=True),
                    "exp_avg": _wrap_like(p, state[f"optim/{name}/exp_avg"]),
                    "exp_avg_sq": _wrap_like(p, state[f"optim/{name}/exp_avg_sq"]),
                }
    if sharded is not None:
        sharded(full_states)
    return int(state["meta/step"])


def _kept_buffers(module) -> list[tuple[str, torch.Tensor]]:
    """The module's persistent buffers that carry training state: an MoE layer's expert biases
    (``layers.<l>.mlp.expert_bias``, :mod:`hetero.runtime.moe`), equal on every rank holding the layer."""
    return [(name, b) for name, b in module.named_buffers() if name.endswith(".expert_bias")]


def _holder_param(module, buffer: str) -> str:
    """A parameter of the buffer's own module (whose holders hold the buffer too)."""
    prefix = buffer.rsplit(".", 1)[0] + "."
    return next(name for name, _ in module.named_parameters() if name.startswith(prefix))


def check_layer_count(path: str, num_layers: int) -> None:
    """Fail when the native checkpoint at ``path`` holds another number of transformer layers than
    the model. Every rank runs it before it meets the others: a rank that failed this check only
    after the process groups were up would leave its peers with a lost connection to report in its
    place, where now each says the same. Not a native checkpoint (a DeepSpeed or Hugging Face
    folder, none yet): nothing to check here."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return
    check_same_model(path, SafeReader(path).read_metadata().state_dict_metadata, {}, num_layers)


def check_same_model(path: str, saved: dict, shapes: dict, num_layers: int | None) -> None:
    """Fail with the differences when the checkpoint at ``path`` was written for another model."""
    problems = []
    if num_layers is not None:
        layers = {int(k.split(".")[1]) for k in saved if k.startswith("model/layers.")}
        if layers != set(range(num_layers)):
            problems.append(f"it holds {len(layers)} transformer layers, the model {num_layers}")
    for name, shape in shapes.items():
        md = saved.get(f"model/{name}")
        if md is None:
            problems.append(f"no tensor model/{name}")
        elif tuple(md.size) != shape:
            problems.append(f"model/{name} is {list(md.size)} there, {list(shape)} in this model")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise HeteroError(f"--load {path}: the checkpoint was written for another model: {'; '.join(problems[:3])}"
                          f"{more} (fix: load a checkpoint saved from this model; any plan of it works)")


def _full_shape(p):
    return p.shape  # DTensor.shape is the global shape


def _wrap_like(p, full: torch.Tensor):
    """``full`` as ``p`` holds it: sharded like a DTensor parameter, else a copy on ``p``'s device."""
    return shard_like(p, full) if hasattr(p, "to_local") else full.to(p.device, copy=True)
