"""The actor: the training runtime's engine (any plan: pp, tp, dp, ZeRO) fed the step's samples and
trained with the GRPO loss of :mod:`hetero.rl.grpo`.

The engine asks its data source for samples by global index, as for any run; here the source is
the channel (:class:`SampleSource`): a first stage gets the token ids of its micro-batches as
their groups arrive (training starts on the first complete groups), a last stage the targets:
a ``(B, T, 4)`` float tensor of [target id, completion mask, advantage, reference log-prob] that
:class:`GRPOLoss` unpacks. The loss is H4's token mean over the whole step (every completion token
of the step weighs the same), so a last stage waits for the step's completion-token count before
its first loss; the earlier stages run ahead on what has arrived.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero.rl.grpo import StepStats, grpo_token_loss
from hetero.rl.rollout import HEADER

TARGET_FIELDS = 4
"""Per token of the targets: id, completion mask, advantage, reference log-prob."""


class SampleSource:
    """The engine's data source (``batch(first, count) -> (tokens, targets)``) over the channel:
    sample ``i`` is sample ``i mod group_size`` of group ``(i mod B) // group_size`` of step
    ``i // B`` (``B``: samples per step)."""

    def __init__(self, channel, samples_per_step: int, group_size: int, seq_length: int, last: bool):
        self.channel, self.B, self.G, self.T, self.last = channel, samples_per_step, group_size, seq_length, last
        self.tokens_of_step: dict[int, int] = {}
        self.length = seq_length
        """Tokens of the rows :meth:`batch` gives: the step's (:func:`hetero.rl.rollout.step_row_length`)."""

    def _row(self, i: int) -> torch.Tensor:
        step, j = divmod(i, self.B)
        return self.channel.group(step, j // self.G)[j % self.G]

    def step_tokens(self, step: int) -> int:
        """The step's completion tokens (every group of the step: a last stage's loss normaliser)."""
        if step not in self.tokens_of_step:
            groups = self.B // self.G
            self.tokens_of_step[step] = int(sum(float(self.channel.group(step, g)[:, 7].sum()) for g in range(groups)))
        return self.tokens_of_step[step]

    def loss_tokens(self, first: int, count: int) -> int:
        """What the engine divides the summed token losses by: the step's completion tokens on a last
        stage (the only one whose loss it scales; the others need not wait for every group)."""
        return self.step_tokens(first // self.B) if self.last else 1

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self._row(i) for i in range(first, first + count)])
        T, ref_at = self.length, HEADER + self.T + 1   # the channel's rows are seq_length wide
        ids = rows[:, HEADER:HEADER + T + 1].long()
        tokens = ids[:, :-1].contiguous()
        targets = torch.zeros(count, T, TARGET_FIELDS, dtype=torch.float32)
        if self.last:
            targets[..., 0] = ids[:, 1:].float()
            pos = torch.arange(T)
            p, n = rows[:, 6].long().unsqueeze(1), rows[:, 7].long().unsqueeze(1)
            # target position k predicts token k + 1: the completion's tokens are p .. p + n - 1
            targets[..., 1] = ((pos >= p - 1) & (pos < p + n - 1)).float()
            targets[..., 2] = rows[:, 5].float().unsqueeze(1)
            targets[..., 3] = rows[:, ref_at:ref_at + T].float()
        return tokens, targets


class GRPOLoss:
    """``loss_fn(logits, targets)`` of one micro-batch for the engine: the sum of its GRPO token terms
    (the engine divides by the step's completion tokens), statistics added to :attr:`stats`. Vocabulary-parallel logits (tp) give each token's log-prob
    through torch's loss_parallel cross-entropy, so no rank holds the whole vocabulary."""

    def __init__(self, clip: float, kl_coef: float, temperature: float):
        self.clip, self.kl_coef = clip, kl_coef
        self.temperature = temperature if temperature > 0 else 1.0
        self.step = 0
        self.stats = StepStats()

    def begin_step(self, step: int) -> None:
        self.step, self.stats = step, StepStats()

    def __call__(self, logits, targets: torch.Tensor):
        from hetero.runtime.model import vocab_parallel, is_dtensor

        B, T = targets.shape[0], targets.shape[1]
        ids, mask, adv, ref = (targets[..., k] for k in range(TARGET_FIELDS))
        mesh = logits.device_mesh if is_dtensor(logits) else None
        with vocab_parallel(logits):
            nll = F.cross_entropy((logits.float() / self.temperature).reshape(B * T, -1), ids.long().reshape(-1),
                                  reduction="none")
        logp = -(nll.to_local() if mesh is not None else nll).view(B, T)
        terms = grpo_token_loss(logp, adv[:, 0], mask, self.clip, None,
                                ref if self.kl_coef > 0 else None, self.kl_coef)
        self.stats.add(terms)
        loss = terms.loss.sum()   # the engine divides by the step's completion tokens (SampleSource.loss_tokens)
        if mesh is not None:   # backpropagated under loss_parallel (hetero.runtime.model.backward_loss)
            from torch.distributed.tensor import DTensor, Replicate

            loss = DTensor.from_local(loss, mesh, [Replicate()])
        return loss
