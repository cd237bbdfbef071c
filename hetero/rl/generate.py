"""Generation on the runtime's own model: prefill + decode with a key/value cache, batched, greedy
or temperature sampling, ending at an end token or after a stop string. ``hetero generate`` and the
RL rollout both call :func:`generate`.

The model is a whole-model :class:`~hetero.runtime.model.StageModel` (first and last stage, one
process: :func:`hetero.rl.load.load_whole_model`); generation runs its own embedding, blocks (with
:class:`~hetero.rl.kv_cache.LayerCache` passed to each block's attention), final norm and head on
its weights, under the autocast its dtype asks for, and computes the head on the last position only.

Determinism: a sample's tokens depend only on (seed, step, prompt index, sample index), the prompt,
the weights and ``batch_rows``, never on which other samples or prompts were generated in the same
call, their order, or the process that generated them (on the same kind of device). Two things make
that hold:

- each row draws its random numbers from its own ``torch.Generator`` seeded by
  :func:`sample_seed` (one uniform per generated token, turned into a token by the inverse of the
  cumulative distribution), never from a shared stream;
- rows are computed in batches of exactly ``batch_rows`` rows whose prompts have the same length
  (no padding, no position shifts); a batch short of rows is filled with copies whose output is
  dropped, and a row that has finished keeps being computed until the batch ends. A matrix product
  gives a row the same bits whatever the other rows hold, but not whatever their number is (the
  kernel depends on it): a fixed row count keeps every row's arithmetic the same.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetero.errors import HeteroError
from hetero.rl.kv_cache import KVCache

DEFAULT_BATCH_ROWS = 16
"""Rows computed together (see the module docstring: results are bit-identical for one value)."""


@dataclass(frozen=True)
class Completion:
    """One generated sample."""

    prompt_index: int
    """The prompt's index (as given in ``prompt_indices``, else its position in ``prompts``)."""
    sample_index: int
    prompt_tokens: list[int]
    tokens: list[int]
    """Generated ids, the end token or the token that completed the stop string included."""
    text: str | None
    """The decoded completion (end token left out), cut right after the stop string; None without a tokenizer."""
    finish_reason: str
    """``stop`` (the stop string), ``eos`` (an end token) or ``length`` (``max_new_tokens``)."""


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample's random stream: a hash of the four numbers (63 bits)."""
    key = f"{int(seed)}:{int(step)}:{int(prompt_index)}:{int(sample_index)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, step: int = 0, samples: int = 1, first_sample: int = 0,
             prompt_indices: Sequence[int] | None = None, eos_id: int | Sequence[int] | None = None,
             stop: str | None = None, tokenizer=None, batch_rows: int = DEFAULT_BATCH_ROWS) -> list[Completion]:
    """Complete every prompt ``samples`` times.

    ``prompts``: token ids (each non-empty; with ``max_new_tokens`` within the model's seq_length).
    ``temperature`` 0: greedy (argmax; ``seed`` unused); > 0: sampling from softmax(logits / T).
    Sample ``k`` of prompt ``i`` is sample index ``first_sample + k`` of prompt index
    ``prompt_indices[i]`` (default ``i``): a caller that splits a group of samples over processes
    gives each its ``first_sample``. ``eos_id``: end token id(s) (default: the tokenizer's).
    ``stop``: a completion ends after this text (needs ``tokenizer``: an object with
    ``decode(ids) -> str``, e.g. :func:`hetero.tokenizer.load_text_tokenizer`'s).
    Returns the completions prompt by prompt, samples in order."""
    spec = model.spec
    if not (model.first and model.last and model.start == 0 and model.end == spec.num_layers):
        raise ValueError("generate needs the whole model in one module (StageModel(spec, (0, L), True, True))")
    if temperature < 0 or max_new_tokens < 1 or samples < 1 or batch_rows < 1:
        raise ValueError("generate: temperature >= 0, max_new_tokens >= 1, samples >= 1 and batch_rows >= 1")
    if stop is not None and (tokenizer is None or not stop):
        raise ValueError("generate: a stop string needs a tokenizer to decode the completion, and must not be empty")
    eos = _eos_set(eos_id if eos_id is not None else getattr(tokenizer, "eos_ids", ()))
    indices = list(range(len(prompts))) if prompt_indices is None else [int(i) for i in prompt_indices]
    if len(indices) != len(prompts):
        raise ValueError("generate: prompt_indices must have one index per prompt")
    prompts = [[int(t) for t in p] for p in prompts]
    for i, p in enumerate(prompts):
        _check_prompt(p, indices[i], max_new_tokens, spec)
    rows = [(i, first_sample + k) for i in range(len(prompts)) for k in range(samples)]
    by_length: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        by_length.setdefault(len(prompts[row[0]]), []).append(row)
    done: dict[tuple[int, int], Completion] = {}
    run = _BatchRun(model, max_new_tokens, temperature, eos, stop, tokenizer)
    for same in by_length.values():
        for start in range(0, len(same), batch_rows):
            batch = same[start:start + batch_rows]
            for (i, s), (tokens, reason) in zip(batch, run([prompts[i] for i, _ in batch], batch_rows,
                                                           [sample_seed(seed, step, indices[i], s) for i, s in batch])):
                done[(i, s)] = _completion(indices[i], s, prompts[i], tokens, reason, tokenizer, stop)
    return [done[row] for row in rows]


def _eos_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else (int(i) for i in eos))


def _check_prompt(prompt: list[int], index: int, max_new_tokens: int, spec) -> None:
    if not prompt:
        raise HeteroError(f"prompt {index}: no tokens (fix: give a non-empty prompt)")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise HeteroError(f"prompt {index}: token id {bad[0]} outside the model's vocabulary 0..{spec.vocab_size - 1} "
                          f"(fix: tokenize with the model's tokenizer)")
    if len(prompt) + max_new_tokens > spec.seq_length:
        raise HeteroError(f"prompt {index}: {len(prompt)} tokens + {max_new_tokens} new ones exceed the model's "
                          f"seq_length {spec.seq_length} (fix: a shorter prompt or fewer new tokens)")


def _completion(index, sample, prompt, tokens, reason, tokenizer, stop) -> Completion:
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(tokens[:-1] if reason == "eos" else tokens)
        if reason == "stop":
            text = text[:text.index(stop) + len(stop)]
    return Completion(index, sample, list(prompt), tokens, text, reason)


class _BatchRun:
    """Generation of one batch of equal-length prompts, ``rows`` rows computed together."""

    def __init__(self, model, max_new_tokens, temperature, eos, stop, tokenizer):
        self.model, self.max_new, self.temperature = model, max_new_tokens, temperature
        self.eos, self.stop, self.tokenizer = eos, stop, tokenizer
        from hetero.runtime.engine import AUTOCAST   # the training forward's autocast, so generation computes as it does

        self.device = next(model.parameters()).device
        low = AUTOCAST[model.spec.dtype]
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=low)) if low else contextlib.nullcontext

    def __call__(self, prompts: list[list[int]], rows: int, seeds: list[int]) -> list[tuple[list[int], str]]:
        real = len(prompts)
        fill = rows - real   # copies of the first prompt, computed and dropped (see the module docstring)
        tokens = torch.tensor(prompts + [prompts[0]] * fill, dtype=torch.long, device=self.device)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        cache = KVCache(self.model.layers.keys(), tokens.shape[1] + self.max_new)
        out: list[list[int]] = [[] for _ in range(real)]
        reason: list[str | None] = [None] * real
        with self.autocast():
            logits = last_logits(self.model, tokens, cache)
            for t in range(self.max_new):
                picked = self._pick(logits, gens, reason, fill).tolist()
                for r in range(real):
                    if reason[r] is None:
                        out[r].append(picked[r])
                        reason[r] = self._finished(out[r])
                if all(reason) or t == self.max_new - 1:
                    break
                logits = last_logits(self.model, torch.tensor(picked, device=self.device).view(rows, 1), cache)
        return [(o, why or "length") for o, why in zip(out, reason)]

    def _pick(self, logits: torch.Tensor, gens, reason, fill: int) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        # one uniform per live row from its own stream (finished and filler rows: a constant, so
        # no stream advances for a token nobody keeps)
        u = [float(torch.rand((), generator=g)) if why is None else 0.5 for g, why in zip(gens, reason)]
        u = torch.tensor(u + [0.5] * fill, dtype=torch.float64, device=logits.device)
        cdf = torch.softmax(logits.double() / self.temperature, dim=-1).cumsum(-1)
        picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        return picked.clamp_(max=logits.shape[-1] - 1)

    def _finished(self, tokens: list[int]) -> str | None:
        if tokens[-1] in self.eos:
            return "eos"
        if self.stop is not None:
            # the whole completion decoded: the stop string may end inside the newest token, and a
            # tail decoded alone can differ from the whole (a leading space, a character split over tokens)
            if self.stop in self.tokenizer.decode(tokens):
                return "stop"
        return None


def last_logits(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (rows, vocab, fp32) of the last of ``tokens`` (rows, T), the positions after the
    ``cache.length`` cached ones, whose keys and values are appended to ``cache``: the model's
    forward (:meth:`~hetero.runtime.model.StageModel.forward`) with the cache, the head on one position."""
    offset = cache.length
    x = model.wte(tokens)
    if hasattr(model, "wpe"):
        x = x + model.wpe(torch.arange(offset, offset + tokens.shape[1], device=tokens.device))
    for i in range(model.start, model.end):
        x = model.layers[str(i)](x, cache.layer(i))
    x = model.final_norm(x[:, -1:])
    x = model.head(x) if hasattr(model, "head") else F.linear(x, model.wte.weight)
    return x[:, -1].float()
