"""Batch-invariant decoding for the deterministic mode: one forward for all running rows, with
every row's numbers exactly those of a forward of that row alone.

A batched forward differs from single-row ones only in the few ops that mix rows: BLAS picks
another kernel (and reduction order) for a matrix of M > 1 rows than for one row (on this
project's CPU build rows agree bit for bit only from M = 4 with one thread, M = 12 with two,
and never with M = 1), grouped expert matmuls see other group sizes, and attention sees a
padded key width. ``RowwiseMode`` intercepts exactly those ops (``F.linear``, grouped mm,
scaled-dot-product attention) inside the model's forward and runs them once per row, with the
shapes that row has when it is forwarded alone: a ``[1, 1, hidden]`` linear, a one-row expert
group, attention over the row's own ``n`` key columns (contiguous, no mask). Every other op of
the forward (embedding, norms, RoPE, routing softmax / top-k, the expert-output sum) works row by
row anyway, so the whole forward, and the KV it appends, is bit-identical to the batch-of-one
forward the deterministic mode ran before (tests/rollout/test_rowwise_decode.py compares them).
What is saved is the per-forward Python cost of the model (modules, masks, cache), which on a
small model is most of a decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_LINEAR = {F.linear, torch._C._nn.linear}
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_GROUPED = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None}


def _alone(offs: torch.Tensor, r: int) -> torch.Tensor:
    """Group ends for row ``r`` of a grouped matmul passed alone: one row in its own group."""
    g = int(torch.searchsorted(offs, torch.tensor(r, dtype=offs.dtype), right=True))
    return (torch.arange(len(offs)) >= g).to(offs.dtype)


class RowwiseMode(TorchFunctionMode):
    """Within ``with RowwiseMode(lengths):`` a one-token-per-row decode forward computes every
    row as if it were alone; ``lengths[r]`` is row ``r``'s key count after this token (its own
    columns are the last ``lengths[r]`` of the padded KV)."""

    def __init__(self, lengths: torch.Tensor):
        super().__init__()
        self.lengths = [int(n) for n in lengths]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            return self._linear(func, *args, **kwargs)
        if func in _GROUPED:
            return self._grouped(func, *args, **kwargs)
        if func in _SDPA:
            return self._attention(func, *args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _linear(func, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() < 2 or x.shape[0] == 1:
            return func(x, weight, bias)
        return torch.cat([func(x[r : r + 1], weight, bias) for r in range(x.shape[0])])

    @staticmethod
    def _grouped(func, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, **kwargs) -> torch.Tensor:
        """Rows sorted by group (``offs``: cumulative ends, ``weight`` [groups, in, out]); each row
        multiplied alone by its group's matrix: a one-row ``mm``, bit-identical to the grouped
        kernel's one-row group (checked by the tests) and several times cheaper to call."""
        if kwargs.get("bias") is not None or kwargs.get("out_dtype") not in (None, x.dtype) or weight.dim() != 3:
            return torch.cat([func(x[r : r + 1], weight, offs=_alone(offs, r), **kwargs) for r in range(len(x))])
        groups = torch.searchsorted(offs, torch.arange(len(x), dtype=offs.dtype), right=True).tolist()
        used = int(offs[-1]) if len(offs) else 0
        out = [torch.mm(x[r : r + 1], weight[g]) for r, g in enumerate(groups[:used])]
        if used < len(x):  # rows past the last group: the kernel leaves them unwritten
            out.append(x.new_zeros((len(x) - used, weight.shape[-1])))
        return torch.cat(out)

    def _attention(self, func, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if q.shape[2] != 1 or q.shape[0] != len(self.lengths):
            raise RuntimeError(f"RowwiseMode decodes one token per row for {len(self.lengths)} rows; "
                               f"attention got queries {tuple(q.shape)}")
        width = k.shape[2]
        out = []
        for r, n in enumerate(self.lengths):
            own_k = k[r : r + 1, :, width - n :].contiguous()
            own_v = v[r : r + 1, :, width - n :].contiguous()
            out.append(func(q[r : r + 1], own_k, own_v, attn_mask=None, dropout_p=dropout_p, is_causal=False,
                            **kwargs))
        return torch.cat(out)
