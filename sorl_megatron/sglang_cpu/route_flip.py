"""A study injector, not an SGLang feature: routing mismatch between rollout and trainer.

``--inject-route-flip-fraction F`` makes a fraction ``F`` of the (token, MoE layer) top-k
choices of this server differ from what its router (and so the trainer's) would choose: one
of the top-k experts is replaced by an expert outside the top-k, and the MoE block computes
with the perturbed choice, so the rollout's log-probs are those of a slightly different
policy. The routes ``return_routed_experts`` reports are the perturbed ones actually used: R3
(replaying the rollout's routes in the trainer) reproduces the rollout's computation, R2
(replaying the trainer's own old-policy routes) and no replay do not.

Which (token, layer) pairs flip, which slot and which replacement are a hash of
``(seed, layer, absolute position, token id)``: a function of the token's content and place,
so the same in any batch, with any prefix-cache hit, at any load, and the same when a later
turn's request carries the position again (a multi-turn episode's routes stay consistent).
The replaced slot's gate weight is the router's own probability of the new expert
(renormalized over the top-k as the router does), as the trainer's replay computes it.

Only routers of the form ``(logits, top-k weights, top-k indices)`` with a softmax over the
experts are supported (Qwen2/Qwen3-MoE, Mixtral); others are refused at start.
"""

from __future__ import annotations

import torch

SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")
_M31 = (1 << 31) - 1
_MUL = 0x45D9F3B  # < 2^31: products with 31-bit values stay below 2^62 (no int64 overflow)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (two multiply-xorshift rounds), elementwise on int64 in [0, 2^31)."""
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    return x ^ (x >> 16)


def flip_hash(seed: int, layer: int, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """31-bit hash of ``(seed, layer, position, token)`` per element (int64 tensors, same shape)."""
    h = _mix(torch.full_like(positions, (seed * 1_000_003 + layer * 7919) & _M31))
    h = _mix(h ^ (positions & _M31))
    return _mix(h ^ (tokens & _M31))


def flip_routes(indices: torch.Tensor, h: torch.Tensor, fraction: float, num_experts: int) -> torch.Tensor:
    """``indices [N, k]`` with one slot replaced where ``hash < fraction * 2^31``.

    The slot is ``hash' % k`` and the new expert the ``(hash'' % (E - k))``-th expert (in id
    order) outside the row's top-k, so a flipped row always names ``k`` distinct experts and
    differs from the original as a set."""
    n, k = indices.shape
    flip = h < int(fraction * (1 << 31))
    if not bool(flip.any()):
        return indices
    h2 = _mix(h ^ 0x2545F491)
    slot = h2 % k
    rank = _mix(h2 ^ 0x1B873593) % (num_experts - k)
    taken = torch.zeros((n, num_experts), dtype=torch.bool, device=indices.device)
    taken.scatter_(1, indices.long(), True)
    free_rank = torch.cumsum((~taken).long(), dim=1) - 1  # rank among the free experts, per expert
    new = ((free_rank == rank[:, None]) & ~taken).long().argmax(dim=1)
    out = indices.clone()
    rows = flip.nonzero()[:, 0]
    out[rows, slot[rows]] = new[rows].to(out.dtype)
    return out


class RouteFlipper:
    """Perturbs one router's output (a forward hook's return value) for the tokens bound by
    :meth:`bind` before each forward."""

    def __init__(self, fraction: float, seed: int):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--inject-route-flip-fraction must be in [0, 1], got {fraction}")
        self.fraction = fraction
        self.seed = seed
        self._positions: torch.Tensor | None = None  # [N] absolute positions of the forward's tokens
        self._tokens: torch.Tensor | None = None

    def check(self, routers: list[torch.nn.Module]) -> None:
        """Refuse, at start, models this injector cannot perturb correctly."""
        if not routers:
            raise ValueError("--inject-route-flip-fraction needs a MoE model (no MoE router found)")
        for m in routers:
            name = type(m).__name__
            if name not in SUPPORTED_ROUTERS:
                raise ValueError(f"--inject-route-flip-fraction supports the routers {SUPPORTED_ROUTERS}, "
                                 f"not {name}")
            if int(m.num_experts) <= int(m.top_k):
                raise ValueError(f"--inject-route-flip-fraction: {name} routes to all {m.num_experts} experts "
                                 "(top_k = num_experts): there is no other expert to flip to")

    def bind(self, ids: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """The tokens of the next forward (``[B, S]``; None: unbind)."""
        if ids is None or positions is None:
            self._positions = self._tokens = None
            return
        self._tokens, self._positions = ids.reshape(-1).long(), positions.reshape(-1).long()

    def apply(self, module: torch.nn.Module, layer: int, out: tuple) -> tuple:
        """The router output ``(logits, weights, indices)`` with this forward's flips applied."""
        if self.fraction <= 0 or self._positions is None:
            return out
        logits, weights, indices = out
        if indices.shape[0] != self._positions.numel():
            raise RuntimeError(f"route flip: the router saw {indices.shape[0]} tokens, the forward bound "
                               f"{self._positions.numel()}")
        h = flip_hash(self.seed, layer, self._positions, self._tokens)
        new = flip_routes(indices, h, self.fraction, int(module.num_experts))
        if new is indices:
            return out
        probs = torch.softmax(logits.float(), dim=-1).gather(1, new.long())
        if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalizes
            probs = probs / probs.sum(dim=-1, keepdim=True)
        changed = (new != indices).any(dim=1, keepdim=True)  # other rows keep the router's own weights
        return logits, torch.where(changed, probs.to(weights.dtype), weights), new
