"""Step timers, token rates, and the metrics file's rows after a resumed step."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ...common import interrupts


@dataclass
class StepTimer:
    """``with timer("name"):`` adds the block's seconds to ``times["time/name"]``."""

    times: dict[str, float] = field(default_factory=dict)

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                interrupts.check()  # a phase of the step: a Ctrl-C that something swallowed stops the run here
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[f"time/{name}"] = timer.times.get(f"time/{name}", 0.0) + time.perf_counter() - self.t0

        return _Ctx()


def tokens_per_second(times: dict[str, float], tokens: dict[str, Optional[float]]) -> dict[str, float]:
    """``time/<pass>_tokens_per_s``: real tokens an engine pass processed over its timed seconds."""
    out = {}
    for name, n in tokens.items():
        seconds = times.get(f"time/{name}", 0.0)
        if n is not None and seconds > 0:
            out[f"time/{name}_tokens_per_s"] = n / seconds
    return out


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the rows of steps after ``step`` (a resumed run logs them again)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))
