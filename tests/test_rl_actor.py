"""The actor's rows (hetero.rl.actor.SampleSource): trimmed to the step's longest possible sample they
give the same GRPO loss and gradients as rows padded to seq_length (padding carries no loss and a
causal model's outputs at real tokens do not depend on what follows them)."""
from __future__ import annotations

import torch

import hetero
from hetero.rl.actor import GRPOLoss, SampleSource
from hetero.rl.grpo import group_advantages
from hetero.rl.load import load_whole_model
from hetero.rl.rollout import pack_group, step_prompts, step_row_length

MODEL = {"name": "rl-tiny", "architecture": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "num_kv_heads": 2, "vocab_size": 256, "seq_length": 16, "dtype": "fp32"}
G = 4


class FakeChannel:
    """Two groups of step 0: prompts of 5 and 7 tokens, completions of 1 to 4 tokens."""

    def __init__(self, T: int, ref: bool):
        gen = torch.Generator().manual_seed(0)
        self.groups = []
        for g, (p, lengths) in enumerate(((5, [1, 4, 2, 3]), (7, [3, 1, 4, 2]))):
            prompt = torch.randint(1, 256, (p,), generator=gen).tolist()
            comps = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]
            rewards = torch.rand(G, generator=gen, dtype=torch.float64)
            ref_logp = -torch.rand(G, T, generator=gen) if ref else None
            self.groups.append(pack_group(0, g, 0, prompt, comps, rewards.tolist(), group_advantages(rewards, G),
                                          ref_logp, T, 0.0, 0.0))

    def group(self, step: int, g: int) -> torch.Tensor:
        return self.groups[g]


def _loss_and_grads(model, channel, length: int, kl_coef: float):
    source = SampleSource(channel, 2 * G, G, MODEL["seq_length"], last=True)
    source.length = length
    tokens, targets = source.batch(0, 2 * G)
    assert tokens.shape == (2 * G, length) and targets.shape[:2] == (2 * G, length)
    model.zero_grad(set_to_none=True)
    loss = GRPOLoss(0.2, kl_coef, 1.0)(model(tokens), targets) / source.loss_tokens(0, 2 * G)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_trimmed_rows_give_the_padded_rows_loss_and_gradients():
    spec = hetero.load_model(MODEL)
    model = load_whole_model(spec, None, seed=1).train()
    for kl_coef in (0.0, 0.1):
        channel = FakeChannel(MODEL["seq_length"], ref=kl_coef > 0)
        padded, padded_grads = _loss_and_grads(model, channel, MODEL["seq_length"], kl_coef)
        trimmed, trimmed_grads = _loss_and_grads(model, channel, 7 + 4, kl_coef)   # longest prompt + max_new_tokens
        assert padded.abs() > 0
        torch.testing.assert_close(trimmed, padded, rtol=1e-6, atol=1e-7)
        for a, b in zip(trimmed_grads, padded_grads):   # sums over fewer zero rows: fp32 rounding only
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_a_step_row_length_holds_its_longest_sample_and_no_more_than_seq_length():
    lengths = [3, 9, 5, 7, 4, 6]
    for step in range(5):
        chosen = step_prompts(0, step, 2, len(lengths))
        assert step_row_length(0, step, 2, lengths, 4, 16) == max(lengths[i] for i in chosen) + 4
        assert step_row_length(0, step, 2, lengths, 4, 8) == min(8, max(lengths[i] for i in chosen) + 4)
