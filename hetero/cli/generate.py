"""``hetero generate``: sample from a trained or imported model with the RL rollout's generation code."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from ._common import positive_int

    p = sub.add_parser(
        "generate", help="complete prompts with a model (greedy at temperature 0, the default)",
        description="Load the whole model into this process (a checkpoint hetero launch --save or import-hf wrote, "
                    "or hf:DIR, a Hugging Face model folder) and complete each prompt: prefill and decode with a "
                    "key/value cache, on a CUDA GPU where there is one, else on the CPU. A completion ends at the "
                    "tokenizer's end token or after --max-new-tokens. Sampling (--temperature > 0) is "
                    "deterministic in --seed and the prompt's position in the input.")
    p.add_argument("--model", required=True, help="model file (YAML) of the weights")
    p.add_argument("--load", required=True, metavar="CKPT|hf:DIR",
                   help="a checkpoint directory (hetero launch --save, hetero import-hf) or hf:DIR")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|HF",
                   help="bytes (UTF-8 bytes as ids, no end token; the default) or a Hugging Face tokenizer.json "
                        "or the folder holding it (with its end token)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="one prompt")
    source.add_argument("--prompts", metavar="FILE.jsonl", help='prompts, one JSON object a line: {"prompt": str}')
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="most tokens generated per prompt (default 64)")
    p.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                   help="0: greedy (the default); > 0: sample from softmax(logits / T)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--json", action="store_true",
                   help='print {"completions": [{"prompt", "completion", "tokens"}]} instead of text')
    p.set_defaults(func=run, inputs={"--model": "model", "--prompts": "prompts"}, outputs={})   # check_outputs_apart


def _temperature(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def run(args) -> int:
    import torch

    from hetero.errors import HeteroError
    from hetero.rl.generate import DEFAULT_BATCH_ROWS, generate
    from hetero.rl.load import load_whole_model
    from hetero.specs.model import load_model
    from hetero.tokenizer import load_text_tokenizer

    from ._common import print_json

    spec = load_model(args.model)
    texts = [args.prompt] if args.prompts is None else _read_prompts(args.prompts)
    tokenizer = load_text_tokenizer(args.tokenizer, spec.vocab_size)
    prompts = [tokenizer.encode(t, special=True) for t in texts]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_whole_model(spec, args.load, device=device)
    try:
        out = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed, tokenizer=tokenizer,
                       batch_rows=min(DEFAULT_BATCH_ROWS, len(prompts)))   # one prompt: no rows computed for nothing
    except HeteroError as e:   # a prompt that does not fit: name the flag it came from
        where = "--prompt" if args.prompts is None else f"--prompts {args.prompts}"
        raise HeteroError(f"{where}: {e}") from None
    if args.json:
        print_json({"completions": [{"prompt": t, "completion": c.text, "tokens": c.tokens}
                                    for t, c in zip(texts, out)]})
        return 0
    for i, (t, c) in enumerate(zip(texts, out)):
        if len(out) > 1:
            print(f"--- prompt {i + 1} of {len(out)} ({len(c.tokens)} tokens, {c.finish_reason})")
        print(t + c.text)
    return 0


def _read_prompts(path: str) -> list[str]:
    """The prompts of a JSONL file (:func:`hetero.rl.prompts.read_prompts`: the RL job's format; the
    other fields of a line are ignored here)."""
    from hetero.rl.prompts import read_prompts
    from hetero.specs.errors import Problems

    problems = Problems(source="--prompts")   # each problem names the file and the line
    records = read_prompts(path, "prompts", problems, "")
    problems.raise_if_any()
    return [r.prompt for r in records]
