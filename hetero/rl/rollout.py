"""The rollout side of an RL step: which prompts a step takes, which rank generates which group,
sampling a group, and the group's row of numbers for the channel.

Placement never changes a sample. A step's prompts are a function of (seed, step); prompt group
``g`` of the step is generated on rollout rank ``g mod R`` by :func:`hetero.rl.generate.generate`
(rows of one batch size, so the floats of its forward passes never depend on what else a rank
generates), and sample ``j`` of it draws its tokens from a generator seeded by (seed, step, g, j).
With the same weights (the weight sync makes them equal bit for bit) any placement gives the same
tokens, rewards and advantages.
"""
from __future__ import annotations

import numpy as np
import torch

SEED_SALT = 0x5EED
"""Keeps the sampling generators apart from the seeds of initialisation and data."""


def step_prompts(seed: int, step: int, per_step: int, count: int) -> list[int]:
    """Indices into the prompts file of the ``per_step`` groups of ``step``: the file in a seeded
    order, epoch after epoch (every prompt once per epoch)."""
    out, orders = [], {}   # one permutation per epoch the step spans, not one per prompt
    for k in range(step * per_step, (step + 1) * per_step):
        epoch, at = divmod(k, count)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, SEED_SALT, epoch]).permutation(count)
        out.append(int(orders[epoch][at]))
    return out


def step_row_length(seed: int, step: int, per_step: int, prompt_lengths: list[int], max_new_tokens: int,
                    seq_length: int) -> int:
    """Tokens of the actor's rows in ``step``: the step's longest prompt (``prompt_lengths``: token
    counts of the prompts file) plus ``max_new_tokens``, at most ``seq_length``. No sample of the step
    is longer. Every actor rank computes it from the job alone, without a message, so a pipeline's
    stages agree on the activations' shape before any group arrives; the positions past a row's end
    are padding: they carry no loss and, the model being causal, change no output at a real token."""
    longest = max(prompt_lengths[i] for i in step_prompts(seed, step, per_step, len(prompt_lengths)))
    return min(seq_length, longest + max_new_tokens)


def groups_of(rank_index: int, num_ranks: int, groups: int) -> list[int]:
    """The prompt groups rollout rank ``rank_index`` of ``num_ranks`` generates, in order."""
    return list(range(rank_index, groups, num_ranks))


@torch.no_grad()
def sequence_logprobs(model, seq: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities of ``seq[:, 1:]`` under ``model`` (logits over the temperature, as the
    GRPO objective takes them): (B, L - 1)."""
    from hetero.rl.grpo import token_logprobs

    logits = model(seq[:, :-1])
    return token_logprobs(logits, seq[:, 1:], temperature if temperature > 0 else 1.0).cpu()


# ---------------------------------------------------------------------------- a group on the wire
HEADER = 8
"""Per row: step, group, sample, policy version, reward, advantage, prompt length, completion length."""


def row_width(seq_length: int) -> int:
    """Numbers per sample on the channel: the header, ``seq_length + 1`` token ids, ``seq_length``
    reference log-probabilities, the seconds the sender's weight sync took before the step and the
    seconds since its generation of the step began."""
    return HEADER + (seq_length + 1) + seq_length + 2


def pack_group(step: int, group: int, version: int, prompt_ids: list[int], completions: list[list[int]],
               rewards: list[float], advantages: torch.Tensor, ref_logp: torch.Tensor | None, seq_length: int,
               sync_s: float, elapsed_s: float) -> torch.Tensor:
    """One group as a (group_size, row_width) float64 tensor (ids below 2**53 are exact)."""
    rows = torch.zeros(len(completions), row_width(seq_length), dtype=torch.float64)
    p = len(prompt_ids)
    for j, comp in enumerate(completions):
        seq = prompt_ids + comp
        rows[j, :HEADER] = torch.tensor([step, group, j, version, rewards[j], float(advantages[j]), p, len(comp)],
                                        dtype=torch.float64)
        rows[j, HEADER:HEADER + len(seq)] = torch.tensor(seq, dtype=torch.float64)
        if ref_logp is not None:
            rows[j, HEADER + seq_length + 1:HEADER + seq_length + len(seq)] = ref_logp[j, :len(seq) - 1].double()
    rows[:, -2] = sync_s
    rows[:, -1] = elapsed_s
    return rows
