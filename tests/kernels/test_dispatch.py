"""The dispatch rule. No GPU can exist on the machines that run these tests, so the CUDA
case is exercised by monkeypatching the device predicate and the kernel entry points."""

from __future__ import annotations

import pytest
import torch

import sorl_kernels.logprobs as lp_kernels
import sorl_kernels.segment as seg_kernels
from sorl_megatron.algorithms import dispatch, segment_mean_broadcast, segment_turns
from sorl_megatron.algorithms.logprobs import TorchLogProbKernels

from .batches import ragged_mask


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("SORL_KERNELS", raising=False)


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    seg = segment_turns(ragged_mask())
    x = torch.randn(seg.mask.shape)
    monkeypatch.setattr(seg_kernels, "segment_mean_broadcast", lambda *a: pytest.fail("Triton called on CPU"))
    assert dispatch.triton_available()  # triton is installed: the CPU decision is about the device
    assert not dispatch.on_triton_device(x)
    assert not dispatch.use_triton(x)
    segment_mean_broadcast(x, seg)  # would fail through the patched kernel


def test_cuda_tensors_take_triton(monkeypatch):
    seg = segment_turns(ragged_mask())
    x = torch.randn(seg.mask.shape)
    monkeypatch.setattr(dispatch, "on_triton_device", lambda t: True)  # "this is a CUDA tensor"
    sentinel = torch.full_like(x, 7.0)
    monkeypatch.setattr(seg_kernels, "segment_mean_broadcast", lambda *a: sentinel)
    assert dispatch.use_triton(x)
    assert segment_mean_broadcast(x, seg) is sentinel


def test_logprobs_pick_kernels(monkeypatch):
    from sorl_megatron.algorithms import logprobs

    seen = []
    real = logprobs.token_logprobs_entropy
    monkeypatch.setattr(logprobs, "token_logprobs_entropy", lambda *a, **k: seen.append(k["kernels"]) or real(*a, **k))
    logits, targets = torch.randn(3, 50), torch.randint(0, 50, (3,))
    dispatch.token_logprobs_entropy(logits, targets)
    monkeypatch.setattr(dispatch, "on_triton_device", lambda t: True)
    dispatch.token_logprobs_entropy(logits, targets)  # runs interpreted: the CPU stand-in for CUDA
    assert seen == [TorchLogProbKernels, lp_kernels.TritonLogProbKernels]


def test_overrides(monkeypatch):
    x = torch.randn(2, 3)
    monkeypatch.setattr(dispatch, "on_triton_device", lambda t: True)
    monkeypatch.setenv("SORL_KERNELS", "torch")
    assert not dispatch.use_triton(x)
    with dispatch.backend("auto"):
        assert dispatch.use_triton(x)
    monkeypatch.setenv("SORL_KERNELS", "triton")
    monkeypatch.setattr(dispatch, "on_triton_device", lambda t: False)
    assert dispatch.use_triton(x)
    with dispatch.backend("torch"):
        assert not dispatch.use_triton(x)
    monkeypatch.setenv("SORL_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SORL_KERNELS"):
        dispatch.use_triton(x)
    with pytest.raises(ValueError, match="backend"):
        with dispatch.backend("gpu"):  # type: ignore[arg-type]
            pass
