"""The kind of a spec file (cluster, model, plan, device catalog), told by its fields.

A file given where another kind belongs (a model file as ``--cluster``) is named as such in one
line, instead of as a list of every field the expected kind does not know.
"""
from __future__ import annotations

from .errors import Problem

MARKERS = {
    "plan": ("pipelines", "global_batch_size"),
    "cluster": ("groups",),
    "model": ("num_layers", "architecture", "hidden_size"),
    "catalog": ("devices",),
    "examples": ("examples",),
}
"""Fields that mark a kind, in the order kinds are told apart (a cluster may have ``devices`` too).
``examples``: the examples index (:mod:`hetero.specs.examples`)."""

FIELDS = {
    "cluster": ("name", "devices", "groups", "network"),
    "model": ("name", "architecture", "num_layers", "hidden_size", "num_attention_heads", "vocab_size",
              "seq_length", "num_kv_heads", "ffn_hidden_size", "activation", "dtype", "tie_embeddings",
              "dropout", "attention", "norm_eps", "rope_theta", "qkv_bias", "moe"),
    "plan": ("global_batch_size", "micro_batch_size", "pipelines", "schedule", "recompute", "zero_stage",
             "interleave", "expert_parallel"),
}
"""The top-level fields of each kind of spec file (tests keep them equal to the dataclasses')."""


def belongs_to(key: str, kind: str) -> str | None:
    """The other kind of file whose top-level field ``key`` is (``recompute`` in a model file:
    ``plan``), or None when it is no field of another kind, or one of ``kind``'s own."""
    if key in FIELDS.get(kind, ()):
        return None
    return next((other for other, fields in FIELDS.items() if other != kind and key in fields), None)


LABEL = {"plan": "a plan", "cluster": "a cluster", "model": "a model", "catalog": "a device catalog",
         "examples": "an examples index"}


def file_kind(data: dict) -> str:
    """``plan``, ``cluster``, ``model``, ``catalog`` or ``unknown`` for a parsed spec mapping. A
    catalog holds ``devices`` alone: a file with other fields beside it is a cluster with a typo
    (``group:``), which the loader's own field check names better. Where the markers of several
    kinds are there, the kind with the most of its own top-level fields wins (ties: the order of
    :data:`MARKERS`), so one misplaced field (``groups:`` in a model file) does not turn the file
    into another kind whose loader would call every other field misplaced."""
    candidates = [kind for kind, fields in MARKERS.items()
                  if any(f in data for f in fields) and (kind != "catalog" or set(data) <= set(fields))]
    if not candidates:
        return "unknown"
    return max(candidates, key=lambda kind: (sum(f in data for f in FIELDS.get(kind, MARKERS[kind])),
                                             -candidates.index(kind)))


def wrong_kind(data: dict, expected: str, source: str) -> Problem | None:
    """A problem when ``data`` has none of ``expected``'s fields but those of another kind, else None."""
    kind = file_kind(data)
    if kind in (expected, "unknown") or any(f in data for f in MARKERS[expected]):
        return None
    seen = ", ".join(f"'{f}'" for f in MARKERS[kind] if f in data)
    wanted = " or ".join(f"'{f}'" for f in MARKERS[expected])
    return Problem("", f"this looks like {LABEL[kind]} file (it has {seen}), not {LABEL[expected]} file",
                   f"give {LABEL[expected]} file here, one with {wanted}", source)
