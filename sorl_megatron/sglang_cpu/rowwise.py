"""Batch-invariant forwards for the deterministic mode: one forward for many rows, with every
row's numbers exactly those of a forward of that row alone.

A batched forward differs from single-row ones only in the few ops that mix rows: BLAS picks
another kernel (and reduction order) for a matrix of M > 1 rows than for one row (on this
project's CPU build rows agree bit for bit only from M = 4 with one thread, M = 12 with two,
and never with M = 1), grouped expert matmuls see other group sizes, and attention sees a
padded key width. ``RowwiseMode`` intercepts exactly those ops (``F.linear``, the MoE experts,
scaled-dot-product attention) inside the model's forward and runs them once per row, with the
shapes that row has when it is forwarded alone. Every other op of the forward (embedding,
norms, RoPE, routing softmax / top-k, the expert-output sum) works token by token anyway, so
the whole forward, and the KV it appends, is bit-identical to the row's forward alone
(tests/rollout/test_rowwise_decode.py compares them). What is saved is the per-forward Python
cost of the model (modules, masks, cache), which on a small model is most of a forward.

Decode (one new token per row): a ``[1, 1, hidden]`` linear per row, run as one ``bmm`` /
``baddbmm`` of the rows by the (expanded, not copied) weight where that gives every row the same
bits (checked on the first call of each shape; see ``_decode_linear``), a one-row expert matmul,
attention over the row's own ``n`` key columns. Prefill (``new[r]`` tokens per row, left-padded to the
longest; the row's past KV right-aligned before them): linears on the row's own positions, the
experts module called on the row's own tokens (its grouped matmul sorts the tokens of all rows
by expert, so the mode swaps the ``forward`` of the model's expert modules while it is active),
and attention on the row's own past and new columns, called as the model's SDPA integration
calls it for the row alone: no mask and ``is_causal`` without a past (grouped KV heads), HF's
boolean causal mask over past + new with the KV heads repeated when there is one, no mask for
a single token.

How: the model's code calls these ops by attribute (``F.linear`` from ``nn.Linear`` and HF's
routers, ``torch.nn.functional.scaled_dot_product_attention`` from HF's SDPA integration,
``F.grouped_mm`` / ``torch._grouped_mm`` from its experts), so while a mode is active on a thread
those attributes are wrappers that send that thread's calls to the mode and every other call to
the original. A ``TorchFunctionMode`` would see the same three, but also every other op of the
forward (about 355 per decode forward of the study's 2-layer MoE, at a few microseconds of Python
each: a fifth of the forward). The wrappers are installed while at least one mode is active in
the process (servers in threads of one test process each have theirs) and removed after the
last; a forward in which the mode saw no linear at all (a model calling them by another name)
is an error, not a silent batched forward.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# (module, attribute, RowwiseMode method) of every op the mode runs row by row
_OPS = [(F, "linear", "_linear"), (F, "scaled_dot_product_attention", "_attention")] + [
    (mod, name, "_grouped") for mod, name in ((torch, "_grouped_mm"), (F, "grouped_mm")) if hasattr(mod, name)]
_active = threading.local()  # .mode: the RowwiseMode active on this thread, if any
_install_lock = threading.Lock()
_originals: dict[tuple[object, str], Callable] = {}  # what the wrappers replaced, while installed
_users = 0  # modes active in the process


def _wrapper(original: Callable, method: str) -> Callable:
    def rowwise_or_original(*args, **kwargs):
        mode = getattr(_active, "mode", None)
        if mode is None or mode._inside:
            return original(*args, **kwargs)
        return getattr(mode, method)(original, *args, **kwargs)

    return rowwise_or_original


def _install() -> None:
    global _users
    with _install_lock:
        if _users == 0:
            for mod, name, method in _OPS:
                _originals[(mod, name)] = getattr(mod, name)
                setattr(mod, name, _wrapper(_originals[(mod, name)], method))
        _users += 1


def _uninstall() -> None:
    global _users
    with _install_lock:
        _users -= 1
        if _users == 0:
            for (mod, name), original in _originals.items():
                setattr(mod, name, original)
            _originals.clear()


def _alone(offs: torch.Tensor, r: int) -> torch.Tensor:
    """Group ends for row ``r`` of a grouped matmul passed alone: one row in its own group."""
    g = int(torch.searchsorted(offs, torch.tensor(r, dtype=offs.dtype), right=True))
    return (torch.arange(len(offs)) >= g).to(offs.dtype)


# Decode linears: one (b)addbmm over the rows, each a one-row product with the weight (expanded,
# not copied), where this machine's kernels give each row bit for bit what the linear gives it
# alone. That is the case on the builds tried here (fp32 and bf16, with and without bias, 1 and 2
# threads), but it is the BLAS's choice, not a rule: it is checked on the first call of each shape,
# dtype and thread count, on the call's own rows, and a shape that differs keeps one linear a row.
_DECODE_BMM: dict[tuple, bool] = {}


def _batched_if_same(key: tuple, batched: Callable[[], torch.Tensor],
                     alone: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``batched()`` where the first call of ``key``'s kind gave the same bits as ``alone()`` (the
    rows one call each), else ``alone()``; the first call computes both and decides."""
    same = _DECODE_BMM.get(key)
    if same is False:
        return alone()
    out = batched()
    if same is None:
        rows = alone()
        _DECODE_BMM[key] = torch.equal(rows, out)
        if not _DECODE_BMM[key]:
            log.warning("RowwiseMode: the batched product %s differs from the rows alone on this machine; "
                        "it keeps one call a row", key)
            return rows
    return out


def _decode_linear(func, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``rows`` single-token rows (``[rows, 1, in]`` or ``[rows, in]``) through the linear, each
    as if alone."""
    key = (x.shape[-1], weight.shape[0], x.dtype, weight.dtype, bias is not None, torch.get_num_threads())

    def batched() -> torch.Tensor:
        one_row, w = x.reshape(rows, 1, x.shape[-1]), weight.t().unsqueeze(0).expand(rows, *weight.t().shape)
        if bias is None:
            out = torch.bmm(one_row, w)
        else:
            out = torch.baddbmm(bias.expand(rows, 1, weight.shape[0]), one_row, w)
        return out.reshape(*x.shape[:-1], -1)

    return _batched_if_same(key, batched, lambda: torch.cat([func(x[r : r + 1], weight, bias) for r in range(rows)]))


def _one_row_products(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``[k, in] @ [in, out]`` with each row a one-row ``mm`` of its own: one ``bmm`` of the rows by
    the expanded matrix where the first call of its kind shows it the same bit for bit."""
    def alone() -> torch.Tensor:
        return torch.cat([torch.mm(x[r : r + 1], matrix) for r in range(len(x))])

    if len(x) == 1:
        return alone()
    key = ("mm", x.shape[-1], matrix.shape[-1], x.dtype, matrix.dtype, torch.get_num_threads())
    return _batched_if_same(
        key, lambda: torch.bmm(x.unsqueeze(1), matrix.unsqueeze(0).expand(len(x), *matrix.shape)).squeeze(1), alone)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE expert collections (HF names them ``*Experts``): what a prefill swaps."""
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


class RowwiseMode:
    """Within ``with RowwiseMode(lengths, new, experts, kv_heads):`` a forward of ``len(lengths)``
    rows computes every row as if it were alone. Row ``r`` feeds ``new[r]`` tokens (default 1: a
    decode step), the last ``new[r]`` of the padded query width, and has ``lengths[r]`` keys after
    them: its past KV is the last ``lengths[r] - new[r]`` columns before the new ones. A prefill
    (any ``new[r] > 1``) needs the model's ``experts`` (:func:`expert_modules`) and its number of
    ``kv_heads``."""

    def __init__(self, lengths, new=None, experts=(), kv_heads: int | None = None):
        super().__init__()
        self.lengths = [int(n) for n in lengths]
        self.new = [1] * len(self.lengths) if new is None else [int(m) for m in new]
        self.prefill = any(m > 1 for m in self.new)
        self.experts = list(experts) if self.prefill else []
        self.kv_heads = kv_heads
        self._inside = False  # within one row's own experts call: every op runs as it is
        self._saved: list = []  # (module, its own instance-level forward or None)
        self._linears = 0  # linears run row by row in this mode

    def __enter__(self):
        if getattr(_active, "mode", None) is not None:
            raise RuntimeError("RowwiseMode: a mode is already active on this thread")
        self._saved = [(m, m.__dict__.get("forward")) for m in self.experts]
        for m in self.experts:
            m.forward = self._own_experts(m.forward)
        _install()
        _active.mode = self
        return self

    def __exit__(self, exc_type, *exc):
        _active.mode = None
        _uninstall()
        for m, own in self._saved:
            if own is None:
                del m.forward  # back to the class's
            else:
                m.forward = own
        if exc_type is None and self._linears == 0:
            raise RuntimeError("RowwiseMode saw no F.linear in the forward: the model calls its linears by "
                               "another name, so its rows were not computed as if alone")
        return False

    def _linear(self, func, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._linears += 1
        rows = len(self.new)
        if x.dim() < 2 or (rows == 1 and not self.prefill):
            return func(x, weight, bias)
        flat = x.dim() == 2  # tokens flattened ([rows * width, in], e.g. a MoE router's input)
        if (flat and x.shape[0] % rows) or (not flat and x.shape[0] != rows):
            raise RuntimeError(f"RowwiseMode: a linear's input {tuple(x.shape)} is not {rows} rows of tokens")
        width = x.shape[0] // rows if flat else x.shape[1]
        if width == 1 and not self.prefill:  # decode: one token a row
            return _decode_linear(func, x, weight, bias, rows)
        take = [min(m, width) for m in self.new]  # a row's own positions: its last ones (the LM head keeps fewer)
        outs = [func(x[r * width + width - t : (r + 1) * width] if flat else x[r : r + 1, width - t :], weight, bias)
                for r, t in enumerate(take)]
        if all(t == width for t in take):  # no padding: the rows' outputs are the whole output
            return torch.cat(outs)
        out = outs[0].new_zeros((*x.shape[:-1], weight.shape[0]))
        rows_view = out.view(rows, width, -1)
        for r, (t, o) in enumerate(zip(take, outs)):
            rows_view[r, width - t :] = o.view(t, -1)
        return out

    def _grouped(self, func, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, **kwargs) -> torch.Tensor:
        """Decode: rows sorted by group (``offs``: cumulative ends, ``weight`` [groups, in, out]);
        each row multiplied alone by its group's matrix: one-row ``mm`` products, bit-identical to
        the grouped kernel's one-row group (checked by the tests) and several times cheaper to
        call, a group's rows in one ``bmm`` where that is the same (:func:`_one_row_products`)."""
        if self.prefill:  # the experts' own calls pass through (_inside); reaching here is a model we do not know
            raise RuntimeError("RowwiseMode: a grouped matmul outside an experts module in a prefill "
                               f"({len(self.experts)} expert modules swapped)")
        if kwargs.get("bias") is not None or kwargs.get("out_dtype") not in (None, x.dtype) or weight.dim() != 3:
            return torch.cat([func(x[r : r + 1], weight, offs=_alone(offs, r), **kwargs) for r in range(len(x))])
        ends = offs.tolist()
        used = ends[-1] if ends else 0
        out, start = [], 0
        for g, end in enumerate(ends):  # a group's rows: each a one-row product with the group's matrix
            if end > start:
                out.append(_one_row_products(x[start:end], weight[g]))
            start = end
        if used < len(x):  # rows past the last group: the kernel leaves them unwritten
            out.append(x.new_zeros((len(x) - used, weight.shape[-1])))
        return torch.cat(out)

    def _own_experts(self, forward):
        """An experts module's ``forward`` that runs the original once per row, on the row's own
        tokens of the flattened ``[rows * width, hidden]`` input (padding positions give 0)."""

        def per_row(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                    **kwargs) -> torch.Tensor:
            rows = len(self.new)
            width = hidden_states.shape[0] // rows
            out = hidden_states.new_zeros(hidden_states.shape)
            self._inside = True
            try:
                for r, m in enumerate(self.new):
                    own = slice(r * width + width - m, (r + 1) * width)
                    out[own] = forward(hidden_states[own], top_k_index[own], top_k_weights[own], *args, **kwargs)
            finally:
                self._inside = False
            return out

        return per_row

    def _attention(self, func, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        rows, width, keys = len(self.lengths), q.shape[2], k.shape[2]
        if q.shape[0] != rows or (not self.prefill and width != 1):
            raise RuntimeError(f"RowwiseMode feeds {self.new} tokens to {rows} rows; attention got queries "
                               f"{tuple(q.shape)}")
        if not self.prefill:  # decode: the row's own last n key columns, no mask
            return torch.cat([
                func(q[r : r + 1], k[r : r + 1, :, keys - n :].contiguous(), v[r : r + 1, :, keys - n :].contiguous(),
                     attn_mask=None, dropout_p=dropout_p, is_causal=False, scale=scale, **kwargs)
                for r, n in enumerate(self.lengths)])
        past_end = keys - width  # the padded past's columns, then the padded new ones
        kv_heads = self.kv_heads or k.shape[1]
        rep = q.shape[1] // kv_heads
        out = q.new_zeros(q.shape)
        for r, (n, m) in enumerate(zip(self.lengths, self.new)):
            p = n - m
            own_k, own_v = (torch.cat([t[r : r + 1, :, past_end - p : past_end], t[r : r + 1, :, keys - m :]], 2)
                            for t in (k, v))
            if own_k.shape[1] != kv_heads:  # the padded batch's mask made the model repeat the KV heads
                own_k, own_v = own_k[:, ::rep].contiguous(), own_v[:, ::rep].contiguous()
            extra = {"enable_gqa": True} if rep > 1 else {}
            mask, causal = None, m > 1
            if m > 1 and p > 0:  # alone: HF's boolean causal mask over past + new, KV heads repeated for it
                mask, causal, extra = torch.ones((m, n), dtype=torch.bool).tril(p)[None, None], False, {}
                own_k, own_v = (t[:, :, None].expand(1, kv_heads, rep, n, t.shape[-1]).reshape(1, kv_heads * rep, n, -1)
                                for t in (own_k, own_v))
            out[r : r + 1, :, width - m :] = func(q[r : r + 1, :, width - m :], own_k, own_v, attn_mask=mask,
                                                  dropout_p=dropout_p, is_causal=causal, scale=scale, **extra)
        return out
