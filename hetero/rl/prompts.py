"""The prompts files of an RL job: one JSON object a line, ``{"prompt": str, ...}``; every other
field goes to the reward function as a keyword argument (the answer to check, say)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from hetero.specs.errors import Problems
from hetero.specs.io import InputFileError, read_user_text


@dataclass(frozen=True)
class PromptRecord:
    """One line of a prompts file."""

    prompt: str
    fields: dict = field(default_factory=dict)
    """The line's other fields: keyword arguments of the reward."""
    line: int = 0
    """Its line number in the file (1-based): what a reward's error names."""
    source: str = ""
    """The file it came from."""

    def where(self) -> str:
        return f"{self.source} line {self.line}"


RESERVED = ("prompt", "completion")
"""Names a prompts line's extra fields may not take: they are the reward's positional arguments."""


def read_prompts(path, what: str, problems: Problems, field_path: str) -> list[PromptRecord]:
    """The records of the prompts file ``path`` (``what``: "prompts" or "eval_prompts", as the job
    names it). Problems (a missing file, a line that is not JSON, has no string "prompt", or a
    field named "completion") are added to ``problems`` under ``field_path`` with the line number;
    blank lines are skipped. An empty file is a problem too."""
    source = str(path)
    try:
        text = read_user_text(path, what)
    except InputFileError as e:
        problems.add(field_path, f"{source}: {e.message}", e.fix)
        return []
    records, bad = [], 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        message = None
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            message, fix = f"not JSON ({e.msg})", 'write one JSON object a line: {"prompt": "..."}'
        else:
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                message, fix = 'has no "prompt" string', 'give each line a "prompt" field holding a string'
            elif "completion" in item:
                message, fix = ('has a "completion" field, which is the reward\'s own argument',
                                "rename the field (the completion is what the policy generates)")
        if message:
            bad += 1
            if bad <= 5:   # a file with one mistake repeated on every line: five are enough to see it
                problems.add(field_path, f"{source} line {number}: {message}", fix)
            continue
        fields = {k: v for k, v in item.items() if k != "prompt"}
        records.append(PromptRecord(item["prompt"], fields, number, source))
    if bad > 5:
        problems.add(field_path, f"{source}: {bad - 5} more bad lines not shown", "fix the lines above first")
    if not records and not bad:
        problems.add(field_path, f"{source}: no prompts in the file", 'write one JSON object a line: {"prompt": "..."}')
    return records


