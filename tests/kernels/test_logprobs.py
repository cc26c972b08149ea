"""Chunked log-probs / entropy: torch reference vs log_softmax, Triton vs the torch
reference (CPU, TRITON_INTERPRET=1), and the tensor-parallel combine with real threads."""

from __future__ import annotations

import threading

import pytest
import torch

from sorl_kernels.logprobs import TritonLogProbKernels
from sorl_megatron.algorithms.logprobs import (
    log_softmax_logprobs_entropy,
    token_logprobs_entropy,
)


def _logits(shape=(3, 4, 301), dtype=torch.float32, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g) * scale).to(dtype)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits, targets


def _run(fn, logits, targets, g_lp, g_ent, **kw):
    x = logits.clone().requires_grad_()
    lp, ent = fn(x, targets, **kw)
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), x)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [64, 1000])  # 301 columns: ragged last chunk / a single chunk
def test_torch_reference_equals_log_softmax_in_double(temperature, chunk):
    logits, targets = _logits(dtype=torch.float64)
    g_lp, g_ent = torch.randn(targets.shape, dtype=torch.float64), torch.randn(targets.shape, dtype=torch.float64)
    ref = _run(log_softmax_logprobs_entropy, logits, targets, g_lp, g_ent, temperature=temperature)
    out = _run(token_logprobs_entropy, logits, targets, g_lp, g_ent, temperature=temperature, chunk_size=chunk)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert (ref[1] > 0).all() and (ref[0] < 0).all()


def test_gradcheck_double():
    logits, targets = _logits(shape=(3, 37), dtype=torch.float64)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda v: token_logprobs_entropy(v, targets, chunk_size=8, temperature=0.8), (x,))


def test_peaked_rows_keep_entropy_accurate():
    """Near-one-hot rows: H is tiny next to lse; the shifted moment avoids the cancellation."""
    logits, targets = _logits(shape=(4, 500), dtype=torch.float64, scale=1.0)
    logits[:, 7] += 60.0
    lp, ent = token_logprobs_entropy(logits.float(), targets, chunk_size=128)
    ref_lp, ref_ent = log_softmax_logprobs_entropy(logits, targets)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-10, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_equals_torch_reference(dtype, tol, temperature):
    logits, targets = _logits(dtype=dtype)
    g_lp, g_ent = torch.randn(targets.shape), torch.randn(targets.shape)
    kw = dict(temperature=temperature)
    ref = _run(token_logprobs_entropy, logits, targets, g_lp, g_ent, chunk_size=64, **kw)
    out = _run(token_logprobs_entropy, logits, targets, g_lp, g_ent, chunk_size=64, kernels=TritonLogProbKernels, **kw)
    for a, b in zip(out[:2], ref[:2]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert out[2].dtype == dtype
    # bf16 gradients: both sides round the same fp32 value, so allow one bf16 ulp.
    gtol = tol if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[2].float(), ref[2].float(), atol=gtol, rtol=gtol)


def test_one_sided_backward_and_strided_rows():
    """Only one output used (the other's grad is None) and logits given as a column slice."""
    logits, targets = _logits(shape=(5, 200))
    wide = torch.cat([logits, torch.randn(5, 9)], dim=1)[:, :200]  # row stride 209
    for kernels in (None, TritonLogProbKernels):
        x = wide.clone().requires_grad_()
        lp, _ = token_logprobs_entropy(x[:, :200], targets, chunk_size=64, kernels=kernels)
        (g,) = torch.autograd.grad(lp.sum(), x)
        ref = torch.softmax(logits, -1).neg().scatter_add(1, targets[:, None], torch.ones(5, 1))
        torch.testing.assert_close(g[:, :200], ref, atol=1e-6, rtol=1e-5)
        y = wide.clone().requires_grad_()
        _, ent = token_logprobs_entropy(y, targets, chunk_size=64, kernels=kernels)
        (ge,) = torch.autograd.grad(ent.sum(), y)
        rx = wide.clone().requires_grad_()
        (gr,) = torch.autograd.grad(log_softmax_logprobs_entropy(rx, targets)[1].sum(), rx)
        torch.testing.assert_close(ge, gr, atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning"
)  # interpreter evaluates both tl.where branches
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_minus_inf_logits_are_excluded(backend):
    """Banned tokens (-inf logits) behave as if absent, with zero gradient and no NaN."""
    logits, targets = _logits(shape=(4, 150))
    targets = targets % 130
    banned = logits.clone()
    banned[:, 130:] = float("-inf")
    g_lp, g_ent = torch.randn(4), torch.randn(4)
    kernels = TritonLogProbKernels if backend == "triton" else None
    lp, ent, grad = _run(token_logprobs_entropy, banned, targets, g_lp, g_ent, chunk_size=64, kernels=kernels)
    ref = _run(log_softmax_logprobs_entropy, logits[:, :130], targets, g_lp, g_ent)
    torch.testing.assert_close(lp, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad[:, :130], ref[2], atol=1e-6, rtol=1e-5)
    assert torch.equal(grad[:, 130:], torch.zeros(4, 20))


class _ThreadGroup:
    """An all-reduce over threads standing in for tensor-parallel ranks."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def hook(self, rank: int):
        def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[rank] = tensor
            self.barrier.wait()
            stacked = torch.stack([t for t in self.slots])  # type: ignore[misc]
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()  # everyone has read before the slots are reused
            return out

        return all_reduce


class _SerializedTriton:
    """The Triton interpreter patches triton.language globally while a kernel runs, so
    interpreted launches from several threads must not overlap (compiled ones may)."""

    lock = threading.Lock()

    @classmethod
    def partials(cls, *args):
        with cls.lock:
            return TritonLogProbKernels.partials(*args)

    @classmethod
    def grad(cls, *args):
        with cls.lock:
            return TritonLogProbKernels.grad(*args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tensor_parallel_shards_equal_full_vocab(backend):
    kernels = _SerializedTriton if backend == "triton" else None
    logits, targets = _logits(shape=(2, 5, 301))
    g_lp, g_ent = torch.randn(targets.shape), torch.randn(targets.shape)
    ref = _run(token_logprobs_entropy, logits, targets, g_lp, g_ent, chunk_size=64)
    bounds = [0, 90, 200, 301]  # uneven shards; targets fall on every shard
    group = _ThreadGroup(3)
    results: list = [None] * 3
    errors: list = []

    def rank(r: int) -> None:
        try:
            lo, hi = bounds[r], bounds[r + 1]
            results[r] = _run(
                token_logprobs_entropy, logits[..., lo:hi].contiguous(), targets, g_lp, g_ent,
                chunk_size=64, vocab_start=lo, all_reduce=group.hook(r), kernels=kernels,
            )
        except BaseException as err:  # surfaced below, a thread cannot fail the test itself
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for lp, ent, _ in results:  # every rank sees the full-vocabulary log-probs and entropy
        torch.testing.assert_close(lp, ref[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ent, ref[1], atol=2e-5, rtol=2e-5)
    grad = torch.cat([res[2] for res in results], dim=-1)  # local backward, no communication
    torch.testing.assert_close(grad, ref[2], atol=2e-6, rtol=2e-5)


def test_validation():
    logits, targets = _logits(shape=(2, 10))
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs_entropy(logits, targets[:1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_entropy(logits, targets, temperature=0.0)
