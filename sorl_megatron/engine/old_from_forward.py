"""The old log-probs a policy update takes from its own forward (``PolicyEngine.update``'s
``old_from_forward``).

The first mini-batch of an update trains on the weights a separate old-logprob pass would read,
so for its rows the update's forward *is* that pass (docs/concepts/engine.md): their pi_old is that
forward's log-probs, detached, in the first mini-batch's passes; before its optimizer step they
are gathered on every rank, and later epochs read those values.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .rl_batch import BatchError


class OldFromForward:
    """Where one update's old log-probs come from. ``rows``: the flags of the rows that take them
    from the forward, padded by a False for the plans' dummy row id (the batch size); None: every
    row's come from the batch. Collected from the first mini-batch's loss pass (``_parts``), then
    gathered (``values``, ``[B + 1, S]``; ``logprobs``: the ``[B, S]`` rows of the batch)."""

    def __init__(self, rows: Optional[torch.Tensor] = None):
        self.rows = rows
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.values: Optional[torch.Tensor] = None
        self.logprobs: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, flags: Any, n: int, first_mini_batch_rows: Callable[[int], torch.Tensor]) -> "OldFromForward":
        """``flags`` (``[n]`` bool, or None) checked against the rows of the update's first
        mini-batch (``first_mini_batch_rows(n)``): a flag elsewhere is a :class:`BatchError`."""
        if flags is None:
            return cls()
        flags = torch.as_tensor(flags).cpu()
        if flags.dtype != torch.bool or tuple(flags.shape) != (n,):
            raise BatchError(f"old_from_forward must be a bool tensor of shape ({n},), got {flags.dtype} "
                             f"{tuple(flags.shape)}")
        outside = flags & ~first_mini_batch_rows(n)
        if outside.any():
            raise BatchError(f"old_from_forward: rows {outside.nonzero().flatten()[:8].tolist()} are not in the "
                             "update's first mini-batch (first_mini_batch_rows): later mini-batches train on "
                             "weights the old log-probs must not see")
        return cls(torch.cat([flags, torch.zeros(1, dtype=torch.bool)]))

    def old_logprobs(self, mb: dict, lp: torch.Tensor) -> torch.Tensor:
        """pi_old of a micro-batch: ``old_logprobs``, except on the flagged rows: there, in the
        first mini-batch's passes, this forward's ``lp`` (detached), and in later epochs the
        values that forward gave (:meth:`keep`)."""
        if self.rows is None:
            return mb["old_logprobs"]
        own = self.rows[mb["rows"]]
        if not own.any():
            return mb["old_logprobs"]
        mine = lp.detach() if self.values is None else self.values[mb["rows"]].to(lp.device)
        return torch.where(own.to(lp.device)[:, None], mine, mb["old_logprobs"])

    def collect(self, mb: dict, old: torch.Tensor) -> None:
        """Hold a micro-batch's pi_old (:meth:`old_logprobs`) where it came from this forward."""
        if old is not mb["old_logprobs"] and self.values is None:
            self._parts.append((mb["rows"], old))

    def keep(self, gather_rows: Callable[..., torch.Tensor], shape: tuple[int, int]) -> None:
        """After the first mini-batch's passes, before its optimizer step: its rows' forward
        log-probs on every rank (``gather_rows(parts, shape, dtype)``, a collective every rank
        calls), read by later epochs and left in ``logprobs``. Once per update."""
        if self.rows is None or self.values is not None:
            return
        parts, self._parts = self._parts, []
        self.values = gather_rows(parts, (shape[0] + 1, shape[1]), torch.float32)  # + the dummy row
        self.logprobs = self.values[: shape[0]]
