"""Small pieces every part of the trainer uses: the prompt stream, step timers, model options."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..bridge.model import ModelOptions
from .config import TrainConfig


@dataclass
class DataStream:
    """Deterministic prompt batches: epoch-wise permutations seeded by (seed, epoch)."""

    indices: list[int]
    batch_size: int
    seed: int
    shuffle: bool = True

    def batch(self, step: int) -> list[int]:
        if not self.indices:
            raise ValueError("no training prompts left (PVPO group sampling may have dropped them all)")
        n = len(self.indices)
        pos = torch.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, i = pos // n, pos % n
        if self.shuffle:  # one permutation per epoch the batch touches (usually one, at most a few)
            for epoch in epochs.unique().tolist():
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
                here = epochs == epoch
                i[here] = order[i[here]]
        return [self.indices[k] for k in i.tolist()]


@dataclass
class StepTimer:
    """``with timer("name"):`` adds the block's seconds to ``times["time/name"]``."""

    times: dict[str, float] = field(default_factory=dict)

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
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


def model_options(cfg: TrainConfig) -> ModelOptions:
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    return ModelOptions(dtype=dtype, fp8=cfg.model.fp8, offload_idle=cfg.model.offload_idle,
                        local_attention=cfg.model.local_attention)
