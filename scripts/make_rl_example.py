"""Write the prompts of the RL example (configs/rl/): sums of two numbers below 20, "12+7=" -> "19".

    python scripts/make_rl_example.py            # (re)write configs/rl/{prompts,eval,sft}.jsonl
    python scripts/make_rl_example.py --sanity   # also: SFT then GRPO in one plain torch process

The 400 pairs (a, b) are shuffled with a fixed seed; 80 are held out as eval.jsonl (greedy accuracy
before and after RL), the other 320 are the RL prompts (prompts.jsonl, the answer as a field the
reward reads) and, with their answers, the SFT warm start's prompt/completion lines (sft.jsonl;
the completion ends with the job's stop string "\\n"). The fast variant under configs/rl/fast reads
the same prompts.jsonl and eval.jsonl.

``--sanity`` checks the task's difficulty without the multi-process runtime: the project's model
(built whole in this process), a short SFT on sft.jsonl, greedy accuracy on eval.jsonl, then a plain
GRPO loop (hetero.rl.grpo, exact-match reward, a generation loop without a KV cache) and the
accuracy after it. It prints the figures; nothing it does is written.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "configs" / "rl"
LIMIT, HELD_OUT, SEED = 20, 80, 1234


def pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, eval) pairs, fixed by SEED."""
    everything = [(a, b) for a in range(LIMIT) for b in range(LIMIT)]
    random.Random(SEED).shuffle(everything)
    return everything[HELD_OUT:], everything[:HELD_OUT]


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path.relative_to(ROOT)} ({len(rows)} lines)")


def make() -> None:
    train, held = pairs()
    write(OUT / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in train])
    write(OUT / "eval.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in held])
    write(OUT / "sft.jsonl", [{"prompt": f"{a}+{b}=", "completion": f"{a + b}\n"} for a, b in train])


# --- the single-process sanity check ----------------------------------------------------------------

def _generate(model, prompts: list[str], max_new: int, temperature: float, gen) -> list[str]:
    """Left-padded batch generation by full recomputation (the model is tiny): stops at a newline."""
    import torch

    ids = [list(p.encode()) for p in prompts]
    width = max(map(len, ids))
    # left-pad with the prompt's first byte repeated? No: pad with spaces, which the data never shows
    # before a prompt; the model sees the same padded prompt in training (see _batch_logprobs).
    rows = torch.tensor([[32] * (width - len(r)) + r for r in ids])
    out = rows
    for _ in range(max_new):
        logits = model(out)[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        out = torch.cat([out, nxt.unsqueeze(1)], 1)
    texts = []
    for row in out[:, width:].tolist():
        text = bytes(b for b in row).decode("utf-8", "replace")
        texts.append(text[: text.index("\n") + 1] if "\n" in text else text)
    return texts


def _accuracy(model, rows: list[dict]) -> float:
    import torch

    with torch.no_grad():
        got = _generate(model, [r["prompt"] for r in rows], 4, 0.0, None)
    return sum(g.strip() == r["answer"] for g, r in zip(got, rows)) / len(rows)


def sanity(sft_steps: int, rl_steps: int, seed: int, rl_lr: float, per_step: int = 8) -> None:
    import torch

    from hetero.rl.grpo import StepStats, group_advantages, grpo_token_loss, token_logprobs
    from hetero.runtime.model import build_stage
    from hetero.specs.model import load_model

    torch.manual_seed(seed)
    spec = load_model(OUT / "model.yaml")
    model = build_stage(spec, (0, spec.num_layers), True, True, seed)
    sft = [json.loads(line) for line in (OUT / "sft.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (OUT / "prompts.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (OUT / "eval.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    t0 = time.perf_counter()
    for _ in range(sft_steps):   # SFT: loss on the completion bytes only
        batch = rng.sample(sft, 32)
        width = max(len(r["prompt"]) + len(r["completion"]) for r in batch)
        x = torch.full((32, width), 32)
        mask = torch.zeros(32, width, dtype=torch.bool)
        for i, r in enumerate(batch):
            p, c = list(r["prompt"].encode()), list(r["completion"].encode())
            x[i, width - len(p) - len(c):] = torch.tensor(p + c)
            mask[i, width - len(c):] = True
        logp = token_logprobs(model(x[:, :-1]), x[:, 1:])
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sft_s = time.perf_counter() - t0
    before = _accuracy(model, held)
    print(f"SFT: {sft_steps} steps of 32 in {sft_s:.1f} s; held-out greedy accuracy {before:.3f}")
    opt = torch.optim.AdamW(model.parameters(), lr=rl_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    group = 8
    t0 = time.perf_counter()
    for step in range(rl_steps):
        chosen = rng.sample(prompts, per_step)
        rows = [r for r in chosen for _ in range(group)]
        with torch.no_grad():
            completions = _generate(model, [r["prompt"] for r in rows], 4, 1.0, gen)
        rewards = torch.tensor([1.0 if c.strip() == r["answer"] else 0.0 for c, r in zip(completions, rows)])
        adv = group_advantages(rewards, group)
        width = max(len(r["prompt"]) + len(c.encode()) for r, c in zip(rows, completions))
        x = torch.full((len(rows), width), 32)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (r, c) in enumerate(zip(rows, completions)):
            p, cb = list(r["prompt"].encode()), list(c.encode())
            x[i, width - len(p) - len(cb):] = torch.tensor(p + cb)
            mask[i, width - len(cb):] = True
        logp = token_logprobs(model(x[:, :-1]), x[:, 1:])
        stats = StepStats()
        terms = grpo_token_loss(logp, adv, mask[:, 1:], clip=0.2)
        stats.add(terms)
        opt.zero_grad()
        (terms.loss.sum() / stats.tokens).backward()
        opt.step()
        if step % 10 == 0 or step == rl_steps - 1:
            print(f"  GRPO step {step}: reward {rewards.mean():.3f} loss {stats.loss:+.4f}")
    after = _accuracy(model, held)
    print(f"GRPO: {rl_steps} steps of {per_step}x{group} in {time.perf_counter() - t0:.1f} s; held-out greedy "
          f"accuracy {before:.3f} -> {after:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanity", action="store_true", help="SFT then GRPO in one plain torch process")
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--prompts-per-step", type=int, default=8,
                        help="the job's prompts_per_step (8 in configs/rl)")
    args = parser.parse_args()
    make()
    if args.sanity:
        sanity(args.sft_steps, args.rl_steps, args.seed, args.rl_lr, args.prompts_per_step)


if __name__ == "__main__":
    main()
