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
    """Yield the passages of a JSONL corpus of ``{"id", "contents"}`` rows (UTF-8).

    Errors name the file and line (from 1), so a broken row in a large corpus is found at
    once: invalid UTF-8, invalid JSON, a row without a string ``contents``. A missing file
    raises FileNotFoundError.
    """
    with open(path, "rb") as f:  # bytes: a decoding error can then name its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)"
                ) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(row, dict) or "contents" not in row:
                raise ValueError(f"{path}:{lineno}: a corpus row needs a 'contents' key")
            if not isinstance(row["contents"], str):
                raise ValueError(f"{path}:{lineno}: 'contents' must be a string, got {row['contents']!r:.100}")
            yield Passage(id=str(row.get("id", lineno - 1)), contents=row["contents"])


def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's rendering: one ``Doc i(Title: t) text`` line per passage, i from 1."""
    return "".join(f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, 1))
