"""Per-step diagnostics the SORL figures plot, as whole-tensor ops (no loop over tokens).

- :func:`advantage_stats`: batch mean and variance of the advantages over policy tokens
  (SORL Fig. 2a).
- :class:`Histogram` / :func:`abs_log_ratio_histogram`: the distribution of ``|log r_t|``,
  ``r_t = pi_theta / pi_old`` (SORL Fig. 4, left), in fixed log-spaced bins. Bin counts, sums
  and extremes are additive (or min / max) over micro-batches, ranks and mini-batches, so an
  engine reduces them exactly; quantiles are read from the merged counts.
- :func:`turn_ratio_spread`: how far apart the turn ratios of one trajectory are.
- :func:`turn_advantage_sign_mixing`: how many turns hold advantages of both signs (per-token
  GAE advantages do; a turn-level ratio then pushes all of a turn's tokens one way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import masked_mean
from .turns import TurnSegments, segment_sum, segment_turns

# |log r| bins: [0, 1e-8), then 20 per decade up to 1e2, then [1e2, inf). A quantile read from
# the counts is exact to within one bin: 10 ** (1 / 20) - 1 = 12% of its value (above 1e-8).
BINS_PER_DECADE = 20
_INNER_EDGES = torch.logspace(-8, 2, 10 * BINS_PER_DECADE + 1, dtype=torch.float64)
ABS_LOG_RATIO_EDGES = torch.cat([torch.zeros(1, dtype=torch.float64), _INNER_EDGES,
                                 torch.full((1,), float("inf"), dtype=torch.float64)])


def advantage_stats(advantages: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """``advantage/mean`` and ``advantage/var`` (population variance) over policy tokens."""
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(mask.shape)
    values = advantages.double()
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return {"advantage/mean": float(mean), "advantage/var": float(var)}


def turn_advantage_sign_mixing(
    advantages: torch.Tensor, loss_mask: torch.Tensor, turn_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """``advantage/turn_sign_mixed_frac``: the fraction of turns whose policy tokens carry both a
    positive and a negative advantage. A turn-level ratio (SORL eq. 4) is shared by the turn's
    tokens, so its clip test passes or fails for the whole turn while the advantages' signs
    disagree; per-sequence advantages (GRPO) never mix (0). Turns as the turn-level losses
    segment them (``segment_turns``)."""
    mask = loss_mask.bool()
    if advantages.dim() == 1:
        return {"advantage/turn_sign_mixed_frac": 0.0}
    turns = segment_turns(mask, turn_ids)
    if turns.num_segments == 0:
        return {"advantage/turn_sign_mixed_frac": 0.0}
    positive = segment_sum((advantages > 0).double(), turns)
    negative = segment_sum((advantages < 0).double(), turns)
    mixed = ((positive > 0) & (negative > 0)).sum(dtype=torch.float64)
    return {"advantage/turn_sign_mixed_frac": float(mixed / turns.num_segments)}


@dataclass
class Histogram:
    """Counts of values in the bins ``[edges[i], edges[i + 1])``, with their exact number, sum,
    sum of squares, min and max (what TensorBoard's raw histogram takes). float64 throughout,
    so counts stay exact far beyond float32's 2 ** 24."""

    edges: torch.Tensor  # [K + 1], edges[0] = 0, edges[-1] = inf
    counts: torch.Tensor  # [K]
    total: torch.Tensor  # sum of the values
    total_squares: torch.Tensor
    minimum: torch.Tensor  # +inf when empty
    maximum: torch.Tensor  # -inf when empty

    @classmethod
    def empty(cls, edges: torch.Tensor, device: torch.device | str = "cpu") -> "Histogram":
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(edges.to(device), torch.zeros(len(edges) - 1, dtype=torch.float64, device=device), zero, zero,
                   torch.full((), float("inf"), dtype=torch.float64, device=device),
                   torch.full((), float("-inf"), dtype=torch.float64, device=device))

    def to(self, device: torch.device | str) -> "Histogram":
        return Histogram(*(t.to(device) for t in (self.edges, self.counts, self.total, self.total_squares,
                                                  self.minimum, self.maximum)))

    @property
    def num(self) -> float:
        return float(self.counts.sum())

    def merge(self, other: "Histogram") -> "Histogram":
        """The histogram of both sets of values (same edges)."""
        return Histogram(
            self.edges, self.counts + other.counts, self.total + other.total,
            self.total_squares + other.total_squares,
            torch.minimum(self.minimum, other.minimum), torch.maximum(self.maximum, other.maximum),
        )

    def quantile(self, q: float) -> float:
        """The ``q`` quantile, interpolated linearly inside its bin (within one bin width of
        the exact one; the bins of the min and the max are bounded by them)."""
        n = self.num
        if n == 0:
            return float("nan")
        counts = self.counts.double().cpu()
        cum = torch.cumsum(counts, 0)
        target = max(min(max(q, 0.0), 1.0) * n, 1e-9)  # q = 0: the first non-empty bin
        i = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64)).clamp(max=len(counts) - 1))
        lo = max(float(self.edges[i]), float(self.minimum))
        hi = min(float(self.edges[i + 1]), float(self.maximum))
        before = float(cum[i] - counts[i])
        frac = (target - before) / float(counts[i]) if counts[i] > 0 else 1.0
        return lo + (hi - lo) * min(max(frac, 0.0), 1.0) if hi >= lo else hi

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}/p50, p90, p99, max``."""
        out = {f"{prefix}/p{int(q * 100)}": self.quantile(q) for q in (0.5, 0.9, 0.99)}
        out[f"{prefix}/max"] = float(self.maximum) if self.num else float("nan")
        return out


def histogram(values: torch.Tensor, mask: torch.Tensor, edges: torch.Tensor) -> Histogram:
    """Histogram of ``values[mask]`` in the bins of ``edges`` (one ``bucketize`` + a masked
    ``scatter_add``), built without a host read: no boolean indexing."""
    m = mask.bool().reshape(-1)
    v = values.detach().double().reshape(-1)
    edges = edges.to(v.device)
    if v.numel() == 0:  # a shape, not a value: no host read
        m, v = torch.zeros(1, dtype=torch.bool, device=v.device), torch.zeros(1, dtype=v.dtype, device=v.device)
    index = torch.bucketize(v, edges[1:-1], right=True)  # bin i holds edges[i] <= v < edges[i + 1]
    counts = torch.zeros(len(edges) - 1, dtype=torch.float64, device=v.device).scatter_add_(0, index, m.double())
    kept = torch.where(m, v, torch.zeros_like(v))
    inf = torch.full_like(v, float("inf"))
    lo, hi = torch.where(m, v, inf).min(), torch.where(m, v, -inf).max()  # +-inf without values
    return Histogram(edges, counts, kept.sum(), (kept * kept).sum(), lo, hi)


def abs_log_ratio_histogram(logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> Histogram:
    """``|log pi_theta - log pi_old|`` over policy tokens, in :data:`ABS_LOG_RATIO_EDGES`."""
    mask = loss_mask.bool()
    diff = torch.where(mask, logprobs.detach().double() - old_logprobs.double(), torch.zeros((), dtype=torch.float64,
                                                                                            device=logprobs.device))
    return histogram(diff.abs(), mask, ABS_LOG_RATIO_EDGES)


def turn_ratio_spread(
    token_log_ratio: torch.Tensor, turns: TurnSegments, clamp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum over rows of (max_k w_k - min_k w_k), number of rows with >= 2 turns)``.

    ``w_k = exp(mean_{t in k} log r_t)`` is turn k's ratio (SORL eq. 4, clamped like the
    losses'); single-turn and empty rows add nothing. Both are sums, additive over micro-batches.
    """
    with torch.no_grad():
        lengths = turns.segment_length.to(token_log_ratio.dtype)
        w = torch.exp((segment_sum(token_log_ratio.detach(), turns) / lengths).clamp(-clamp, clamp))
        return turn_ratio_spread_of(w, turns)


def turn_ratio_spread_of(turn_ratios: torch.Tensor, turns: TurnSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`turn_ratio_spread` from the ``[S]`` turn ratios themselves (a turn-level loss has them)."""
    with torch.no_grad():
        w = turn_ratios.detach()
        rows = turns.turns_per_row.numel()
        hi = w.new_full((rows,), float("-inf")).scatter_reduce(0, turns.segment_row, w, "amax")
        lo = w.new_full((rows,), float("inf")).scatter_reduce(0, turns.segment_row, w, "amin")
        multi = turns.turns_per_row >= 2
        spread = torch.where(multi, hi - lo, torch.zeros((), dtype=w.dtype, device=w.device))
        return spread.sum(), multi.sum().to(w.dtype)
