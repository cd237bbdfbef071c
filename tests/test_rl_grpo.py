"""The GRPO objective (hetero.rl.grpo) against a straightforward computation, token by token."""
from __future__ import annotations

import math

import pytest
import torch

from hetero.rl.grpo import (ADVANTAGE_EPS, StepStats, completion_tokens, group_advantages, grpo_loss,
                            grpo_token_loss, token_logprobs)


def _advantages_by_hand(rewards: list[float], g: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g]
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))
        out += [(r - mean) / (std + ADVANTAGE_EPS) for r in group]
    return out


def _loss_by_hand(logp, old, ref, adv, mask, clip, kl_coef):
    """Sum over sequences and tokens of the per-token GRPO loss, divided by the completion tokens;
    also the clipped-token count and the k3 sum."""
    total, tokens, clipped, kl_sum = 0.0, 0, 0, 0.0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            tokens += 1
            r = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            low, high = 1 - clip, 1 + clip
            r_clipped = low if r < low else high if r > high else r
            surrogate = min(r * a, r_clipped * a)
            if r_clipped * a < r * a:
                clipped += 1
            d = ref[i][t] - logp[i][t]
            k3 = math.exp(d) - d - 1
            kl_sum += k3
            total += -surrogate + kl_coef * k3
    return total / tokens, clipped, kl_sum, tokens


def _batch(seed=0, b=6, t=7, g=3):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    # old log-probs far enough from the current ones that some ratios leave [0.8, 1.2]
    old = logp.detach() + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
    rewards = torch.rand(b, generator=gen, dtype=torch.float64)
    lengths = [t, 3, 5, 1, 6, 4][:b]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = True          # completions right-aligned after a prompt of varying length
    return logp, old, ref, rewards, mask, g


def test_group_advantages_equal_the_formula_and_zero_for_equal_rewards():
    rewards = [0.0, 1.0, 1.0, 0.5, 2.0, 2.0, 2.0, 2.0]
    got = group_advantages(torch.tensor(rewards), 4)
    assert got.tolist() == pytest.approx(_advantages_by_hand(rewards, 4), rel=1e-6)
    assert got[4:].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_loss_equals_a_token_by_token_computation(kl_coef):
    logp, old, ref, rewards, mask, g = _batch()
    adv = group_advantages(rewards, g)
    clip = 0.2
    want, want_clipped, want_kl, tokens = _loss_by_hand(logp.tolist(), old.tolist(), ref.tolist(),
                                                        adv.tolist(), mask.tolist(), clip, kl_coef)
    assert 0 < want_clipped < tokens   # the clip is active on some tokens, not all
    got = grpo_loss(logp, adv, mask, clip, old_logp=old, ref_logp=ref, kl_coef=kl_coef)
    assert got.item() == pytest.approx(want, rel=1e-6)
    stats = StepStats()
    stats.add(grpo_token_loss(logp, adv, mask, clip, old, ref, kl_coef))
    assert stats.tokens == tokens == completion_tokens(mask)
    assert stats.loss == pytest.approx(want, rel=1e-6)
    assert stats.clip_fraction == pytest.approx(want_clipped / tokens)
    assert stats.kl == pytest.approx(want_kl / tokens, rel=1e-6)
    assert stats.kl > 0


def test_gradient_equals_the_derivative_by_hand():
    """d loss / d logp of a token: (-A r where the unclipped term is the smaller, else 0)
    + kl_coef (1 - exp(ref - logp)), over the step's completion tokens."""
    logp, old, ref, rewards, mask, g = _batch(seed=1)
    adv = group_advantages(rewards, g)
    clip, kl_coef = 0.2, 0.05
    grpo_loss(logp, adv, mask, clip, old_logp=old, ref_logp=ref, kl_coef=kl_coef).backward()
    n = int(mask.sum())
    want = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            lp, a = logp[i, t].item(), adv[i].item()
            r = math.exp(lp - old[i, t].item())
            stopped = (r < 1 - clip and a < 0) or (r > 1 + clip and a > 0)
            pg = 0.0 if stopped else -a * r
            want[i, t] = (pg + kl_coef * (1 - math.exp(ref[i, t].item() - lp))) / n
    assert torch.allclose(logp.grad, want, rtol=1e-6, atol=1e-12)
    assert (logp.grad[~mask] == 0).all()


def test_micro_batches_with_the_step_normaliser_sum_to_the_whole_step():
    logp, old, ref, rewards, mask, g = _batch(seed=2)
    adv = group_advantages(rewards, g)
    whole = grpo_loss(logp, adv, mask, 0.2, old, ref, kl_coef=0.1)
    n = completion_tokens(mask)
    parts = [grpo_loss(logp[s], adv[s], mask[s], 0.2, old[s], ref[s], kl_coef=0.1, normaliser=n)
             for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6)
    merged = StepStats()
    for s in (slice(0, 2), slice(2, 6)):
        part = StepStats()
        part.add(grpo_token_loss(logp[s], adv[s], mask[s], 0.2, old[s], ref[s], 0.1))
        merged = StepStats.from_tensor(merged.as_tensor() + part.as_tensor())
    assert merged.loss == pytest.approx(whole.item(), rel=1e-6)


def test_on_policy_ratio_is_one_with_the_policy_gradient():
    logp, _, _, rewards, mask, g = _batch(seed=3)
    adv = group_advantages(rewards, g)
    loss = grpo_loss(logp, adv, mask, 0.2)
    n = completion_tokens(mask)
    want = -sum(adv[i].item() * int(mask[i].sum()) for i in range(len(adv))) / n
    assert loss.item() == pytest.approx(want, rel=1e-6, abs=1e-9)
    loss.backward()
    expect = -(adv.unsqueeze(1) * mask) / n
    assert torch.allclose(logp.grad, expect.to(logp.dtype), atol=1e-7)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, adv, mask, 0.2, kl_coef=0.1)


def test_token_logprobs_with_temperature():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 3), generator=gen)
    got = token_logprobs(logits, targets, temperature=0.7)
    for i in range(2):
        for t in range(3):
            row = [x / 0.7 for x in logits[i, t].tolist()]
            log_z = math.log(sum(math.exp(x) for x in row))
            assert got[i, t].item() == pytest.approx(row[targets[i, t]] - log_z, rel=1e-5)
