"""The expert linears of the TE-less layer spec: one grouped matmul, or a loop over experts.

``expert_linear(x, weights, tokens_per_expert, mode)`` computes, for contiguous row groups of
``x`` (group ``e`` holds ``tokens_per_expert[e]`` rows), ``x_e @ weights[e].T``. Two ways:

* **grouped**: ``torch._grouped_mm``, one kernel per direction whatever the number of experts.
  The group ends are a cumulative sum built on the input's device (from the router's device
  tensor of counts, which ``local_spec.LocalGroupedMLP`` hands through as :class:`DeviceCounts`,
  or from host counts copied from pinned memory without waiting), so nothing is read back to
  the host. The per-expert weights are stacked into one ``[experts, out, in]`` tensor in the
  forward and again in the backward (nothing extra is kept for the backward: the loop's memory);
  the weight gradients come back as views of one ``[experts, out, in]`` gradient.
* **loop**: one ``F.linear`` per expert (the counts read to the host once per layer).

``mode="auto"`` takes the grouped kernel on CUDA at compute capability 9.x in bfloat16, and the loop
elsewhere. Torch's CPU grouped kernel (float32 and bfloat16) gives the loop's numbers but is slower
than the loop on the CPU (1.2-6x at the shapes of ``benchmarks/bench_expert_gemm.py``, much of it
the weight stacking), so the CPU loops unless forced. The grouped kernel needs every row stride to
be a multiple of 16 bytes (group sizes need no alignment); shapes that are not loop.
``mode="loop"`` always loops (the recipe's ``model.expert_gemm: loop``). The environment variable
``SORL_EXPERT_GEMM`` (``grouped`` / ``loop``), when set, overrides the mode: ``grouped`` takes the
kernel wherever torch has it (the CPU included).
"""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch
import torch.nn.functional as F

EXPERT_GEMMS = ("auto", "loop")
ENV = "SORL_EXPERT_GEMM"

class DeviceCounts:
    """Tokens per expert kept on the device, handed to the expert linears in place of the host
    list megatron's ``TEGroupedMLP.forward`` makes of them (its first line is ``.tolist()``,
    a read per MoE layer): ``tolist()`` returns this object itself, the grouped kernel reads
    :attr:`tensor` (no host read) and the loop reads the list once for both linears
    (:meth:`as_list`). ``local_spec.LocalGroupedMLP`` does the handing over."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._list: list[int] | None = None

    def tolist(self) -> "DeviceCounts":
        return self

    def as_list(self) -> list[int]:
        if self._list is None:
            self._list = self.tensor.tolist()
        return self._list


Counts = Union[torch.Tensor, Sequence[int], DeviceCounts]


def grouped_available(x: torch.Tensor, out_features: int) -> bool:
    """Whether torch's grouped kernel runs ``x @ W.T`` (W ``[out_features, x.shape[1]]``) here."""
    if not hasattr(torch, "_grouped_mm") or x.dim() != 2:
        return False
    if x.device.type == "cuda":
        ok_device = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] == 9
    else:
        ok_device = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    align = 16 // x.element_size()  # no rows at all (an expert-parallel rank's share can be empty): the loop
    return ok_device and x.shape[0] > 0 and x.shape[1] % align == 0 and out_features % align == 0


def use_grouped(mode: str, x: torch.Tensor, out_features: int) -> bool:
    """The module docstring's choice; the environment variable wins over ``mode``."""
    forced = os.environ.get(ENV, "")
    if forced not in ("", "grouped", "loop"):
        raise ValueError(f"{ENV} must be 'grouped' or 'loop', got {forced!r}")
    if mode not in EXPERT_GEMMS:
        raise ValueError(f"expert_gemm must be one of {EXPERT_GEMMS}, got {mode!r}")
    if forced == "loop" or (not forced and (mode == "loop" or x.device.type != "cuda")):
        return False
    return grouped_available(x, out_features)


def group_ends(counts: Counts, device: torch.device) -> torch.Tensor:
    """int32 cumulative row counts on ``device``, without a device-to-host read (host counts go
    up from pinned memory, so the host does not wait for the device either)."""
    if isinstance(counts, DeviceCounts):
        counts = counts.tensor
    host = counts if isinstance(counts, torch.Tensor) else torch.tensor(list(counts), dtype=torch.int32)
    if host.device.type == "cpu" and device.type == "cuda":
        host = host.to(torch.int32).pin_memory().to(device, non_blocking=True)
    return torch.cumsum(host.to(device), 0, dtype=torch.int32)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, ends, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(grad, torch.stack(weights), offs=ends)
        if any(ctx.needs_input_grad[2:]):
            dw = torch._grouped_mm(grad.t(), x, offs=ends)  # [experts, out, in]
        return (dx, None, *(dw.unbind(0) if dw is not None else [None] * len(weights)))


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Counts) -> torch.Tensor:
    """``torch._grouped_mm`` over the row groups (see the module docstring)."""
    return _GroupedLinear.apply(x.contiguous(), group_ends(counts, x.device), *weights)


def loop_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Counts) -> torch.Tensor:
    """One ``F.linear`` per expert: the reference the grouped kernel is tested against."""
    if isinstance(counts, DeviceCounts):
        splits = counts.as_list()
    else:
        splits = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    outs = [F.linear(c, w) for c, w in zip(torch.split(x, splits, dim=0), weights)]
    return torch.cat(outs, dim=0) if outs else x.new_empty(0, 0)


def expert_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Counts, mode: str = "auto"):
    if use_grouped(mode, x, weights[0].shape[0]):
        return grouped_linear(x, weights, counts)
    return loop_linear(x, weights, counts)
