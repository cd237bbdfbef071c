"""Predicted vs measured peak memory of one training step (CPU, fp32, a GPT block stack in torch).

The model is built here from nn.Linear / nn.LayerNorm / matmul / softmax, op for op the
decomposition of ``hetero.predictor.ops`` (tied embeddings, learned positions, no dropout), with
recomputation as Megatron does it (torch.utils.checkpoint: full, each block; selective, the
attention core).
Measured: the persistent tensors (weights, gradients kept with zero_grad(set_to_none=False) as
Megatron's grad buffer does, Adam moments after a warm-up step) plus the peak storage bytes of
tensors live at once during the second step, tracked by hetero.memplan's AllocationRecorder (a
TorchDispatchMode: every op's new storages, freed when their last tensor dies).

    python benchmarks/bench_memory.py            # prints a table, writes benchmarks/out/memory.json
"""
from __future__ import annotations

import json
import math
import os
import sys

CASES = [  # (layers, hidden, heads, seq, micro-batch, vocab, recompute)
    (2, 128, 4, 128, 2, 1000, "none"),
    (4, 256, 8, 128, 4, 2000, "none"),
    (4, 256, 4, 256, 2, 5000, "none"),
    (6, 384, 6, 64, 8, 3000, "none"),
    (2, 512, 8, 512, 1, 8000, "none"),
    (2, 128, 4, 128, 2, 1000, "full"),
    (6, 384, 6, 64, 8, 3000, "full"),
    (2, 512, 8, 512, 1, 8000, "selective"),
    # small vocabularies: the layers' backward transients, not the loss, make the peak
    (4, 512, 8, 512, 1, 64, "none"),
    (4, 512, 8, 512, 1, 64, "selective"),
    (4, 512, 8, 512, 1, 64, "full"),
    (2, 256, 4, 256, 4, 64, "full"),
    (2, 1024, 16, 256, 2, 256, "full"),
]


def build(layers, hidden, heads, seq, vocab, recompute="none"):
    import torch
    from torch import nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)
            self.ln2 = nn.LayerNorm(hidden)
            self.fc1 = nn.Linear(hidden, 4 * hidden)
            self.fc2 = nn.Linear(4 * hidden, hidden)

        @staticmethod
        def core(q, k, v, mask):
            b, _, s, d = q.shape
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            return (p @ v).transpose(1, 2).reshape(b, s, heads * d)

        def body(self, x, mask):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            if recompute == "selective":  # Megatron's selective: the attention core is recomputed
                ctx = checkpoint(self.core, q, k, v, mask, use_reentrant=False)
            else:
                ctx = self.core(q, k, v, mask)
            x = x + self.out(ctx)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

        def forward(self, x, mask):
            if recompute == "full":  # only the block's input is kept; its forward runs again in backward
                return checkpoint(self.body, x, mask, use_reentrant=False)
            return self.body(x, mask)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Parameter(torch.zeros(seq, hidden))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1))

        def forward(self, ids):
            x = self.tok(ids) + self.pos
            for blk in self.blocks:
                x = blk(x, self.mask)
            return self.ln_f(x) @ self.tok.weight.t()   # tied LM head

    return GPT()


def measure(layers, hidden, heads, seq, mbs, vocab, recompute="none", seed=0) -> int:
    """Peak bytes of live tensors during one training step (after a warm-up step)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = build(layers, hidden, heads, seq, vocab, recompute)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, vocab, (mbs, seq))
    tgt = torch.randint(0, vocab, (mbs, seq))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(ids).view(-1, vocab), tgt.view(-1))
        loss.backward()
        opt.step()

    step()  # creates gradients and Adam states
    persistent_tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    for st in opt.state.values():
        persistent_tensors += [v for v in st.values() if torch.is_tensor(v)]
    persistent_tensors += list(model.buffers())
    persistent = sum(t.numel() * t.element_size() for t in persistent_tensors if t.dim() > 0)
    from hetero.memplan import AllocationTrace
    from hetero.memplan.record import AllocationRecorder

    tracker = AllocationRecorder(ignore={t.untyped_storage()._cdata for t in persistent_tensors})
    with tracker:
        step()
    return persistent + AllocationTrace(tracker.events).lower_bound_bytes()


def predicted(layers, hidden, heads, seq, mbs, vocab, recompute="none") -> float:
    from hetero.predictor.memory import stage_memory
    from hetero.specs.model import load_model

    model = load_model({"name": "bench", "architecture": "gpt", "num_layers": layers, "hidden_size": hidden,
                        "num_attention_heads": heads, "vocab_size": vocab, "seq_length": seq, "dtype": "fp32"})
    return stage_memory(model, "cpu", 1, mbs, layers, recompute, 0, 1, 1, True, True).total


def main() -> int:
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = []
    print(f"{'layers':>6} {'hidden':>6} {'heads':>5} {'seq':>5} {'mbs':>4} {'vocab':>6} {'recompute':>9} "
          f"{'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
    for case in CASES:
        p = predicted(*case)
        m = measure(*case)
        err = (p - m) / m
        rows.append({"case": dict(zip(("layers", "hidden", "heads", "seq", "mbs", "vocab", "recompute"), case)),
                     "predicted_bytes": p, "measured_bytes": m, "relative_error": err})
        print(f"{case[0]:>6} {case[1]:>6} {case[2]:>5} {case[3]:>5} {case[4]:>4} {case[5]:>6} {case[6]:>9} "
              f"{p / 2**20:>14.2f} {m / 2**20:>13.2f} {err:>+7.1%}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "memory.json"), "w") as f:
        json.dump(rows, f, indent=2)
    worst = max(abs(r["relative_error"]) for r in rows)
    print(f"worst relative error {worst:.1%}")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
