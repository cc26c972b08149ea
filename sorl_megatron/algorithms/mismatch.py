"""Leading indicators of train/inference mismatch and clipping, as whole-tensor ops.

- :func:`importance_ess`: effective sample size of the importance weights
  ``w_t = pi_old(y_t) / mu(y_t)`` (trainer over rollout engine): Kish's
  ``ESS = (sum w)^2 / sum w^2`` (Kong 1992; Owen, "Monte Carlo theory, methods and examples",
  ch. 9), as a fraction of the number of tokens ``N`` (1 when every weight is equal, ``1/N``
  when one dominates), over the whole batch and averaged over sequences.
- :func:`k3_kl`: Schulman's k3 estimator ``r - 1 - log r`` ("Approximating KL divergence",
  2020; ``kl.kl_penalty``'s, in float64) of ``KL(mu || pi_old)`` from tokens sampled by ``mu``,
  ``r = pi_old / mu``: unbiased and never negative.
- :func:`route_flip_counts`: how many (token, MoE layer) top-k expert sets differ between two
  routings (rollout engine vs trainer), as sets (the order of the k ids is irrelevant).
- :func:`clip_counts`: PPO's clipping indicators (the update's gradient is cut where
  ``A > 0, r > high`` or ``A < 0, r < low``) at token level, and at turn level with SORL's turn
  ratio ``w_k = exp(mean_{t in k} log r_t)`` (SORL / ST-PPO, arXiv 2511.20718, eq. 4).

Everything returns sums or fractions of the tensors given; an engine reduces the sums across
ranks.
"""

from __future__ import annotations

import torch

from .aggregation import count64
from .kl import kl_penalty
from .turns import TurnSegments, segment_sum


def importance_ess(log_w: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ESS / N over all masked tokens, mean over rows with tokens of the row's ESS / N)``.

    ``log_w [B, T]``: log importance weights (``log pi_old - log mu``); ``mask [B, T]``: the
    tokens that count. Computed in float64 with the maximum log-weight factored out (ESS is
    scale-free), so no weight overflows. ``(1, 1)`` when there are no tokens."""
    m = mask.bool()
    lw = log_w.double()
    neg = torch.tensor(float("-inf"), dtype=lw.dtype, device=lw.device)

    def ess_frac(dim):
        top = torch.where(m, lw, neg).amax(dim=dim, keepdim=dim is not None)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.where(m, torch.exp(lw - top), torch.zeros_like(lw))
        n = m.sum(dim=dim, dtype=lw.dtype)
        s1, s2 = w.sum(dim=dim), (w * w).sum(dim=dim)
        return torch.where(n > 0, s1 * s1 / (s2 * n).clamp(min=1e-300), torch.ones_like(n)), n

    batch, _ = ess_frac(None)
    rows, n = ess_frac(1)
    has = n > 0
    rows_with_tokens = has.sum(dtype=lw.dtype)  # no host read: a mean over those rows, 1 without any
    per_seq = torch.where(has, rows, torch.zeros_like(rows)).sum() / rows_with_tokens.clamp(min=1)
    per_seq = torch.where(rows_with_tokens > 0, per_seq, torch.ones_like(per_seq))
    return batch, per_seq


def k3_kl(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """Mean over masked tokens of ``r - 1 - log r``, ``log r = logp - behaviour_logp`` clamped to
    ``[-clamp, clamp]``: the k3 estimate of ``KL(behaviour || p)`` (0 without tokens), in float64."""
    m = mask.bool()
    k3 = kl_penalty(behaviour_logp, logp, "k3", clamp, dtype=torch.float64)  # sampled by the behaviour policy
    return torch.where(m, k3, torch.zeros_like(k3)).sum() / m.sum().clamp(min=1)


def route_flip_counts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs that differ, pairs compared)`` of two routings ``[..., layers, k]`` (int expert
    ids; a (token, layer) pair with a -1 in either is not compared: no route there)."""
    if a.shape != b.shape:
        raise ValueError(f"route_flip_counts: routings of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    both = ((a >= 0) & (b >= 0)).all(dim=-1)
    differs = (torch.sort(a, dim=-1).values != torch.sort(b, dim=-1).values).any(dim=-1)
    return (differs & both).sum(dtype=torch.float64), both.sum(dtype=torch.float64)


def clip_counts(
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    turns: TurnSegments | None = None,
    clamp: float = 20.0,
    turn_log_ratio: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Clipped tokens and turns: ``{"tokens_clipped", "tokens", "turns_clipped", "turns"}`` (sums).

    A token is clipped when ``A_t > 0`` and ``r_t > high`` or ``A_t < 0`` and ``r_t < low``,
    ``r_t = exp(token_log_ratio)``; a turn likewise with its ratio ``w_k`` (eq. 4, the log
    clamped to ``[-clamp, clamp]``) and its tokens' mean advantage. Without ``turns`` only the
    token counts. ``turn_log_ratio``: the ``[S]`` mean log-ratio of each turn when the caller
    has it (a turn-level loss's own: the same float32 sums), else it is summed here."""
    m = mask.bool()
    with torch.no_grad():
        lr = token_log_ratio.detach().float()
        adv = advantages.detach().float()
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(lr)
        log_low, log_high = torch.log(torch.tensor(low)), torch.log(torch.tensor(high))
        # clipped: A > 0 and log r > log_high, or A < 0 and log r < log_low; with the band's
        # middle and half-width, sign(A) (log r - middle) > half-width says both (A = 0: never)
        middle, half = (log_high + log_low) / 2, (log_high - log_low) / 2
        tok = (torch.sign(adv) * (lr - middle) > half) & m
        out = {"tokens_clipped": count64(tok), "tokens": count64(m)}
        if turns is not None:
            length = turns.segment_length.float()
            mean = segment_sum(lr, turns) / length if turn_log_ratio is None else turn_log_ratio.detach()
            w = mean.clamp(-clamp, clamp)
            a = segment_sum(adv, turns) / length
            clipped = ((a > 0) & (w > log_high)) | ((a < 0) & (w < log_low))
            out["turns_clipped"] = count64(clipped)
            out["turns"] = torch.tensor(float(turns.num_segments), dtype=torch.float64)
        return out
