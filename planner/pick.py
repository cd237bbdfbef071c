"""Pick one plan from a front with a rule in words: ``"fastest under 40 USD/Mtok"``,
``"cheapest within 5% of fastest"``, ``"most resilient over 50000 tokens/s and under 0.3 J/token"``.

A rule is a superlative (which objective to optimise) and any number of conditions joined by
``and``: ``under X UNIT`` / ``over X UNIT`` (an objective's bound, the unit naming it), and
``within P% of SUPERLATIVE`` (that objective within P percent of its best on the front).
"""
from __future__ import annotations

import re

from hetero.errors import HeteroError
from hetero.predictor.objectives import MAXIMISE

SUPERLATIVES = {"fastest": "throughput", "cheapest": "cost", "most efficient": "energy", "leanest": "energy",
                "roomiest": "memory_headroom", "most headroom": "memory_headroom", "most resilient": "resilience"}
UNIT_WORDS = {"usd/mtok": "cost", "usd": "cost", "tokens/s": "throughput", "tok/s": "throughput",
              "j/token": "energy", "j/tok": "energy", "headroom": "memory_headroom",
              "resilience": "resilience", "kept": "resilience"}
_SUP = "|".join(sorted(SUPERLATIVES, key=len, reverse=True))
GRAMMAR = ("RULE = SUPERLATIVE [CONDITION [and CONDITION]...]; SUPERLATIVE: " + ", ".join(SUPERLATIVES)
           + "; CONDITION: 'under X UNIT', 'over X UNIT' (UNIT: USD/Mtok, tokens/s, J/token, headroom, "
             "resilience) or 'within P% of SUPERLATIVE'")


class PickError(HeteroError):
    """A rule that does not parse, names an objective not searched, or no plan of the front meets."""


def _value(item, name):
    return item.objectives[name]


def _better(name: str, a: float, b: float) -> bool:
    return a > b if name in MAXIMISE else a < b


def parse_rule(rule: str):
    """``(objective to optimise, [(objective, op, value or ("within", pct, objective))...])``."""
    text = " ".join(rule.lower().split())
    m = re.match(rf"^({_SUP})\b\s*(.*)$", text)
    if not m:
        raise PickError(f"--pick '{rule}': starts with no superlative ({GRAMMAR})")
    goal, rest = SUPERLATIVES[m.group(1)], m.group(2).strip()
    conds = []
    for part in [p.strip() for p in re.split(r"\band\b", rest)] if rest else []:
        w = re.match(rf"^within\s+([0-9.]+)\s*%\s+of\s+(?:the\s+)?({_SUP})$", part)
        b = re.match(r"^(under|below|over|above|at most|at least)\s+([0-9.eE+-]+)\s*(%?)\s*(\S+)$", part)
        if w:
            conds.append((SUPERLATIVES[w.group(2)], "within", float(w.group(1)) / 100.0))
        elif b and b.group(4) in UNIT_WORDS:
            value = float(b.group(2)) / (100.0 if b.group(3) else 1.0)
            op = "<=" if b.group(1) in ("under", "below", "at most") else ">="
            conds.append((UNIT_WORDS[b.group(4)], op, value))
        else:
            raise PickError(f"--pick '{rule}': cannot read '{part}' ({GRAMMAR})")
    return goal, conds


def pick(front: list, rule: str, names) -> object:
    """The plan of ``front`` (items with ``.objectives``) that ``rule`` chooses; PickError when the
    rule does not parse, needs an objective not in ``names``, or no plan meets it."""
    goal, conds = parse_rule(rule)
    for obj in [goal] + [c[0] for c in conds]:
        if obj not in names:
            raise PickError(f"--pick '{rule}': needs objective '{obj}', which was not searched "
                            f"(add it to --objectives)")
    keep = list(front)
    for obj, op, value in conds:
        if op == "within":
            vals = [_value(p, obj) for p in front]
            best = max(vals) if obj in MAXIMISE else min(vals)
            lim = best * (1 - value) if obj in MAXIMISE else best * (1 + value)
            keep = [p for p in keep if (_value(p, obj) >= lim if obj in MAXIMISE else _value(p, obj) <= lim)]
        else:
            keep = [p for p in keep if (_value(p, obj) <= value if op == "<=" else _value(p, obj) >= value)]
        if not keep:
            vals = [_value(p, obj) for p in front]
            lo, hi = min(vals), max(vals)
            raise PickError(f"--pick '{rule}': no plan of the front meets it ({obj} on the front spans "
                            f"{lo:.4g} to {hi:.4g})")
    best = keep[0]
    for p in keep[1:]:
        if _better(goal, _value(p, goal), _value(best, goal)):
            best = p
    return best


__all__ = ["pick", "parse_rule", "PickError", "SUPERLATIVES"]
