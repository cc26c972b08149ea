"""One switch between the Triton kernels (``sorl_kernels``) and the pure-torch references.

Rule: Triton when every tensor of the call is a CUDA tensor and Triton imports (a CUDA
tensor implies a driver); the torch path otherwise, i.e. always on CPU. Results agree to
fp32 tolerance (only the order of fp32 additions differs; ``tests/kernels``).

Overrides: ``SORL_KERNELS=torch`` forces the torch path (e.g. to bisect a GPU numerics
issue); ``SORL_KERNELS=triton`` forces Triton, which on CPU tensors only works under
``TRITON_INTERPRET=1`` (the kernel tests use this to run the whole loss through Triton).
:func:`backend` does the same for a block of code.

Entry points (the algorithm core and the Megatron engine call these, never the kernels):

- :func:`segment_mean_broadcast`: turn / sequence log-ratio means (``turns.py``);
- :func:`token_logprobs_entropy`: log-probs and entropy from (TP-sharded) logits;
- :func:`clipped_surrogate`: the fused clipped surrogate + clip indicators (``policy_loss.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Literal

import torch

from . import logprobs as _logprobs
from .reference import clipped_surrogate_torch, segment_mean_broadcast_torch

Backend = Literal["auto", "torch", "triton"]
_ENV = "SORL_KERNELS"
_override: Backend | None = None


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``triton`` and the ``sorl_kernels`` package import."""
    try:
        import triton  # noqa: F401

        import sorl_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def on_triton_device(tensor: torch.Tensor) -> bool:
    """The device predicate of the ``auto`` rule: a CUDA tensor (hence a driver) and Triton."""
    return tensor.is_cuda and triton_available()


def current_backend() -> Backend:
    value = _override or os.environ.get(_ENV, "auto") or "auto"
    if value not in ("auto", "torch", "triton"):
        raise ValueError(f"{_ENV}={value!r}: expected auto, torch or triton")
    return value  # type: ignore[return-value]


@contextlib.contextmanager
def backend(name: Backend) -> Iterator[None]:
    """Force a backend inside a ``with`` block (takes precedence over ``SORL_KERNELS``)."""
    global _override
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"backend {name!r}: expected auto, torch or triton")
    previous, _override = _override, name
    try:
        yield
    finally:
        _override = previous


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` goes to Triton."""
    choice = current_backend()
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(f"{_ENV}=triton but triton / sorl_kernels do not import")
        return True
    return all(on_triton_device(t) for t in tensors)


def segment_mean_broadcast(
    values: torch.Tensor, segment_index: torch.Tensor, segment_length: torch.Tensor
) -> torch.Tensor:
    """Mean of ``values`` over each token's segment, broadcast back (SORL eq. 4 in log space);
    segments as in :class:`.turns.TurnSegments`."""
    if use_triton(values):
        from sorl_kernels.segment import segment_mean_broadcast as kernel

        return kernel(values, segment_index, segment_length)
    return segment_mean_broadcast_torch(values, segment_index, segment_length)


def token_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    all_reduce: _logprobs.AllReduce | None = None,
    chunk_size: int = _logprobs.DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.logprobs.token_logprobs_entropy` with the kernels picked by the rule above."""
    kernels: _logprobs.LogProbKernels = _logprobs.TorchLogProbKernels
    if use_triton(logits):
        from sorl_kernels.logprobs import TritonLogProbKernels

        kernels = TritonLogProbKernels
        chunk_size = min(chunk_size, 1024)  # a register block, not a temporary's width
    return _logprobs.token_logprobs_entropy(
        logits, targets, temperature=temperature, vocab_start=vocab_start, all_reduce=all_reduce,
        chunk_size=chunk_size, kernels=kernels,
    )


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float, clip_high: float, dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_token, clip_high, clip_low, dual)`` of :func:`.reference.clipped_surrogate_torch`."""
    if use_triton(ratio):
        from sorl_kernels.surrogate import clipped_surrogate as kernel

        return kernel(ratio, advantages, mask, clip_low, clip_high, dual_clip)
    return clipped_surrogate_torch(ratio, advantages, mask, clip_low, clip_high, dual_clip)
