"""Checkpoints with torch.distributed.checkpoint, addressable by layer and tensor name.

Keys are plan-independent: ``model/layers.<l>.<tensor>``, ``model/wte.weight``, ...,
``optim/<param>/exp_avg``, ``optim/<param>/exp_avg_sq``, ``optim/<param>/step``, ``meta/step``
and, for fp16 runs, ``meta/loss_scale``. Every tensor is stored unsharded, written once (by the lowest rank holding it; tp
shards are gathered first), so a run with a different plan (other layer splits, tp degrees,
pipeline shapes) loads exactly the tensors its ranks hold and shards them locally.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from hetero.runtime.grads import full_tensor


def _local_from_full(like, full: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


def save_checkpoint(path: str, module, optimizer, holders: dict, rank: int, step: int,
                    loss_scale: float | None = None) -> None:
    """Write this rank's share of the plan-independent checkpoint (a collective: every rank calls it);
    ``loss_scale``: the fp16 dynamic loss scale to resume with."""
    state: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        owner = holders[name][0] == rank
        full = full_tensor(p.detach())  # collective inside the tp group: every tp rank takes part
        st = optimizer.state.get(p, {})
        moments = {k: full_tensor(st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st}
        if owner:
            state[f"model/{name}"] = full.clone()
            for k, v in moments.items():
                state[f"optim/{name}/{k}"] = v.clone()
            if "step" in st:
                state[f"optim/{name}/step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()
    if rank == 0:
        state["meta/step"] = torch.tensor(step, dtype=torch.int64)
        if loss_scale is not None:
            state["meta/loss_scale"] = torch.tensor(loss_scale, dtype=torch.float64)
    dcp.save(state, checkpoint_id=path)


def saved_loss_scale(path: str) -> float | None:
    """The fp16 loss scale stored in the checkpoint at ``path``, or None (fp32/bf16, older checkpoints)."""
    reader = dcp.FileSystemReader(path)
    if "meta/loss_scale" not in reader.read_metadata().state_dict_metadata:
        return None
    state = {"meta/loss_scale": torch.tensor(0.0, dtype=torch.float64)}
    dcp.load(state, checkpoint_id=path)
    return float(state["meta/loss_scale"])


def load_checkpoint(path: str, module, optimizer) -> int:
    """Fill this rank's parameters and AdamW state from ``path``; returns the step to resume at."""
    reader = dcp.FileSystemReader(path)
    available = set(reader.read_metadata().state_dict_metadata)
    state: dict[str, torch.Tensor] = {"meta/step": torch.tensor(0, dtype=torch.int64)}
    params = dict(module.named_parameters())
    for name, p in params.items():
        shape = tuple(_full_shape(p))
        state[f"model/{name}"] = torch.empty(shape)
        for k in ("exp_avg", "exp_avg_sq"):
            if f"optim/{name}/{k}" in available:
                state[f"optim/{name}/{k}"] = torch.empty(shape)
        if f"optim/{name}/step" in available:
            state[f"optim/{name}/step"] = torch.tensor(0.0)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for name, p in params.items():
            local = _local_from_full(p, state[f"model/{name}"])
            (p.to_local() if hasattr(p, "to_local") else p).copy_(local)
            if f"optim/{name}/exp_avg" in state:
                optimizer.state[p] = {
                    "step": state[f"optim/{name}/step"].clone(),
                    "exp_avg": _wrap_like(p, state[f"optim/{name}/exp_avg"]),
                    "exp_avg_sq": _wrap_like(p, state[f"optim/{name}/exp_avg_sq"]),
                }
    return int(state["meta/step"])


def _full_shape(p):
    return p.shape  # DTensor.shape is the global shape


def _wrap_like(p, full: torch.Tensor):
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return full.clone()
