"""Passages in Search-R1's corpus format and their rendering as observations."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Passage:
    """One retrieved document. ``contents`` is the title line, then the passage text."""

    id: str
    contents: str
    score: float | None = None

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""


def read_corpus(path: str | Path) -> Iterator[Passage]:
    """Yield the passages of a JSONL corpus of ``{"id", "contents"}`` rows.

    Errors name the file and line, so a broken row in a large corpus is found at once.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(row, dict) or "contents" not in row:
                raise ValueError(f"{path}:{lineno}: a corpus row needs a 'contents' key")
            yield Passage(id=str(row.get("id", lineno - 1)), contents=str(row["contents"]))


def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's rendering: one ``Doc i(Title: t) text`` line per passage, i from 1."""
    return "".join(f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, 1))
