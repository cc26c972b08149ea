"""The prompt stream: which dataset rows each step's groups are drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
