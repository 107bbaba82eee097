"""Prompt sets for greedy-generation checks (``kvq verify`` drift, ``kvq serve-smoke``).

A prompts file is either ``.jsonl`` (one JSON object per line with a ``"prompt"``
string) or any other text file (one prompt per non-empty line). The built-in set is
short, varied English (instructions, facts, code, arithmetic, a list), written for
this project.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError
from .files import read_limited

BUILTIN_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: What is 12 times 7?\nAnswer:",
    "Three tips for staying healthy are",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "The theory of relativity, proposed by Albert Einstein,",
    "Once upon a time, in a small village by the mountains,",
)

MAX_PROMPTS = 10_000
MAX_PROMPT_CHARS = 100_000
#: the largest prompts file kvq reads (10,000 prompts of 6 KiB)
MAX_PROMPTS_BYTES = 64 << 20


def load_prompts(path: str | Path | None) -> list[str]:
    """The built-in set (``path`` None) or the prompts of ``path``.

    Raises:
        InputError: missing/unreadable file, a folder or socket, above 64 MiB, not UTF-8, a
            bad JSONL line (named by its number), no prompts, more than 10,000 prompts or one
            above 100,000 characters.
    """
    if path is None:
        return list(BUILTIN_PROMPTS)
    p = Path(path)
    raw = read_limited(p, "prompts file", MAX_PROMPTS_BYTES, pipes=True)  # a pipe (<(...), /dev/stdin) is read, bounded
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"prompts file {p} is not UTF-8 text") from None
    prompts: list[str] = []
    if p.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{p}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise InputError(f"{p}:{i}: expected an object with a \"prompt\" string")
            prompts.append(obj["prompt"])
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    prompts = [q for q in prompts if q.strip()]
    if not prompts:
        raise InputError(f"prompts file {p} holds no prompts")
    if len(prompts) > MAX_PROMPTS:
        raise InputError(f"prompts file {p} holds {len(prompts)} prompts; the limit is {MAX_PROMPTS}")
    for i, q in enumerate(prompts, 1):
        if len(q) > MAX_PROMPT_CHARS:
            raise InputError(f"prompt {i} of {p} has {len(q)} characters; the limit is {MAX_PROMPT_CHARS}")
    return prompts
