"""Checkpoints made for a test: a plan-independent checkpoint of a model at step 3 whose every value
is random, so a reshard that puts any element in the wrong place shows."""
from __future__ import annotations

__all__ = ["random_state_checkpoint"]


def random_state_checkpoint(path: str, model: dict) -> None:
    """Parameters ``randn``, moments ``randn * 1e-3`` and ``rand * 1e-6``, step 3, seeded: no two
    values alike (and none a bf16 value), the same on every call."""
    import torch

    import hetero
    from hetero.runtime.checkpoint import save_assembled_checkpoint
    from hetero.runtime.reshard.space import ParameterSpace

    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in ParameterSpace(hetero.load_model(model)).shapes.items():
        state[f"model/{name}"] = torch.randn(shape, generator=g)
        state[f"optim/{name}/exp_avg"] = torch.randn(shape, generator=g) * 1e-3
        state[f"optim/{name}/exp_avg_sq"] = torch.rand(shape, generator=g) * 1e-6
        state[f"optim/{name}/step"] = torch.tensor(3.0)
    save_assembled_checkpoint(path, state, 3, None)
