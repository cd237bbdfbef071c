"""The GRPO objective as plain torch functions: group-relative advantages, the clipped-ratio loss of
each completion token, the KL penalty to a frozen reference, and the step's statistics.

Conventions (fixed here so every placement and plan computes the same numbers):

- A step holds ``prompts_per_step x group_size`` completions, group-major: the completions of
  prompt ``p`` are rows ``p * group_size ... (p + 1) * group_size - 1``.
- Advantage of completion ``i`` of a group: ``(r_i - mean(r)) / (std(r) + eps)`` with the
  **unbiased** (n - 1) standard deviation of the group's rewards and ``eps = 1e-4``, as TRL's
  GRPOTrainer does. A group whose rewards are all equal gets advantage 0 for every completion (it
  says nothing about which completion is better).
- Per completion token ``t`` of completion ``i``, with ``r = exp(logp - old_logp)``:
  ``loss_it = -min(r * A_i, clip(r, 1 - clip, 1 + clip) * A_i) + kl_coef * k3_it`` where
  ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (the non-negative, unbiased "k3" estimator
  of KL(policy || reference) TRL uses).
- The step's loss is the **sum over every completion token of the step, divided by the step's total
  number of completion tokens** (a token-level mean, TRL's ``loss_type="dapo"``): a long completion
  weighs by its length, and the value does not depend on how the step is cut into micro-batches,
  pipelines or data-parallel replicas. :func:`grpo_token_loss` gives the per-token terms (zero off
  the completion mask); a runtime sums them per micro-batch and divides by
  :func:`completion_tokens` of the whole step (its masked-loss normaliser), and the sum of those
  parts equals :func:`grpo_loss` of the whole step.
- ``logp``, ``old_logp`` and ``ref_logp`` are log-probabilities of the sampled tokens under the
  temperature-scaled policy (logits divided by the sampling temperature, as TRL does), so the ratio
  compares the same distribution the rollout sampled from. ``old_logp=None`` means on-policy (one
  update per batch, staleness 0): the ratio is ``exp(logp - logp.detach())``, 1 in value with the
  policy-gradient derivative.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-4
"""Added to a group's reward standard deviation before dividing (TRL's value)."""


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """``(r - group mean) / (group std + eps)`` for group-major ``rewards`` of shape ``(n,)`` with
    ``n`` a multiple of ``group_size`` (>= 2); unbiased std. Returns float32 ``(n,)``."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not whole groups of {group_size}")
    grouped = rewards.detach().to(torch.float32).view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each ``targets`` token under ``softmax(logits / temperature)``: logits
    ``(..., V)``, targets ``(...)`` of ids; returns ``(...)`` float32 (differentiable in logits)."""
    scaled = logits.to(torch.float32)
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class TokenTerms:
    """The per-token pieces of the GRPO loss, each ``(B, T)`` and zero off the completion mask."""

    loss: torch.Tensor
    """The loss of each completion token (differentiable); sum it and divide by the step's tokens."""
    kl: torch.Tensor
    """k3 of each token (detached; zero when no reference is given)."""
    clipped: torch.Tensor
    """1.0 where the clipped term was the smaller one, so the token's policy gradient is zero (the
    ratio left ``[1 - clip, 1 + clip]`` in the direction the advantage pushes), else 0 (detached)."""
    mask: torch.Tensor
    """The completion mask as float32."""


def grpo_token_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float,
                    old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                    kl_coef: float = 0.0) -> TokenTerms:
    """The GRPO terms of every token of a batch of completions.

    ``logp``: ``(B, T)`` log-probs of the sampled tokens under the policy being trained (with
    gradient); ``advantages``: ``(B,)`` (:func:`group_advantages`); ``mask``: ``(B, T)``, true on the
    completion's tokens (not prompt, not padding); ``clip``: the ratio clip epsilon;
    ``old_logp``: ``(B, T)`` under the policy that sampled them (None: on-policy);
    ``ref_logp``: ``(B, T)`` under the frozen reference, needed when ``kl_coef > 0``."""
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs the reference log-probabilities (ref_logp)")
    mask = mask.to(torch.float32)
    logp = logp.to(torch.float32)
    old = logp.detach() if old_logp is None else old_logp.detach().to(torch.float32)
    ratio = torch.exp(logp - old)
    adv = advantages.detach().to(torch.float32).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
    loss = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(loss)
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp.detach().to(torch.float32))
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    with torch.no_grad():
        r = ratio.detach()
        active = ((r < 1.0 - clip) & (adv < 0)) | ((r > 1.0 + clip) & (adv > 0))
    return TokenTerms(loss=loss * mask, kl=kl.detach() * mask, clipped=active.to(torch.float32) * mask, mask=mask)


def completion_tokens(mask: torch.Tensor) -> int:
    """The number of completion tokens under ``mask``: the step's loss normaliser (sum it over
    every micro-batch of the step before dividing)."""
    return int(mask.to(torch.bool).sum().item())


def grpo_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float,
              old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0, normaliser: int | None = None) -> torch.Tensor:
    """The GRPO loss of a batch: the sum of :func:`grpo_token_loss` over its completion tokens
    divided by ``normaliser`` (default: this batch's own completion tokens; give the whole step's
    count when this batch is one micro-batch of it). A batch without completion tokens gives 0."""
    terms = grpo_token_loss(logp, advantages, mask, clip, old_logp, ref_logp, kl_coef)
    n = completion_tokens(mask) if normaliser is None else normaliser
    return terms.loss.sum() / max(n, 1)


@dataclass
class StepStats:
    """Sums over a step's completion tokens, added micro-batch by micro-batch (and summed over
    ranks by the runtime: :meth:`as_tensor` / :meth:`from_tensor`), then read as the means the run
    summary reports. The four sums are one float64 tensor where the terms are: :meth:`add` reads
    nothing back (on an accelerator each read waits for the device); a field reads its sum."""

    sums: torch.Tensor | None = None
    """Completion tokens, loss sum, KL sum and clipped tokens; None before the first :meth:`add`."""

    def add(self, terms: TokenTerms) -> None:
        sums = torch.stack([terms.mask.sum().double(), terms.loss.detach().sum().double(),
                            terms.kl.detach().sum().double(), terms.clipped.sum().double()])
        self.sums = sums if self.sums is None else self.sums + sums

    def _sum(self, i: int) -> float:
        return float(self.sums[i]) if self.sums is not None else 0.0

    tokens = property(lambda self: self._sum(0), doc="Completion tokens of the step.")
    loss_sum = property(lambda self: self._sum(1), doc="Sum of the token losses.")
    kl_sum = property(lambda self: self._sum(2), doc="Sum of the token KL terms.")
    clipped = property(lambda self: self._sum(3), doc="Completion tokens whose gradient the clip stopped.")

    def as_tensor(self) -> torch.Tensor:
        """The four sums as one float64 CPU tensor (for an all-reduce)."""
        return self.sums.cpu() if self.sums is not None else torch.zeros(4, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepStats:
        return cls(t.to(torch.float64))

    @property
    def loss(self) -> float:
        """The step's loss (token mean)."""
        return self.loss_sum / self.tokens if self.tokens else 0.0

    @property
    def kl(self) -> float:
        """Mean k3 KL to the reference over the step's completion tokens (0 without a reference)."""
        return self.kl_sum / self.tokens if self.tokens else 0.0

    @property
    def clip_fraction(self) -> float:
        """Fraction of the step's completion tokens whose gradient the clip stopped."""
        return self.clipped / self.tokens if self.tokens else 0.0
