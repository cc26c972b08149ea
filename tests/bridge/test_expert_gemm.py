"""The TE-less expert linears: torch's grouped matmul computes the loop over experts.

``grouped_gemm.grouped_linear`` (one ``torch._grouped_mm`` per direction) against
``grouped_gemm.loop_linear`` (one ``F.linear`` per expert) on the CPU, where torch 2.13 has the
kernel in float32 and bfloat16: outputs, input gradients and every expert's weight gradient,
experts without tokens included. The layer spec's modules keep their parameter names and shapes
(checkpoints unchanged) whichever path runs. In-process: megatron's expert RNG tracker is
replaced by a no-op (no parallel state is initialized here).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from sorl_megatron.bridge import grouped_gemm
from sorl_megatron.bridge.grouped_gemm import ENV, grouped_linear, loop_linear, use_grouped

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")

COUNTS = {  # rows per expert; zeros are experts the router sent nothing
    "one_expert": [7],
    "four_one_empty": [5, 0, 3, 8],
    "eight_mostly_empty": [0, 0, 0, 0, 0, 0, 0, 16],
    "sixteen_routed": None,  # random routing of 96 rows, some experts empty
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the largest magnitude


def _counts(name: str) -> list[int]:
    if COUNTS[name] is not None:
        return COUNTS[name]
    idx = torch.randint(0, 16, (96,), generator=torch.Generator().manual_seed(3))
    idx[idx % 5 == 0] = 1  # experts 0, 5, 10, 15 get nothing
    return torch.bincount(idx, minlength=16).tolist()


def _run(fn, counts, dtype, d_in=16, d_out=24, seed=0):
    """Output, input gradient and each expert's weight gradient of ``fn``."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, d_in, generator=g).to(dtype).requires_grad_()
    ws = [torch.randn(d_out, d_in, generator=g).to(dtype).requires_grad_() for _ in counts]
    y = fn(x, ws, counts)
    y.backward(torch.randn(rows, d_out, generator=g).to(dtype))
    wgrads = [w.grad if w.grad is not None else torch.zeros_like(w) for w in ws]
    return [y.detach(), x.grad, *wgrads]


def _assert_close(got, want, dtype):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
        diff = (a.float() - b.float()).abs().max().item() if b.numel() else 0.0
        assert diff <= TOLERANCE[dtype] * scale, (diff, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(COUNTS))
def test_the_grouped_kernel_computes_the_loop_forward_and_backward(name, dtype):
    counts = _counts(name)
    _assert_close(_run(grouped_linear, counts, dtype), _run(loop_linear, counts, dtype), dtype)


def test_the_counts_may_be_a_device_tensor_or_a_host_list():
    counts = _counts("four_one_empty")
    as_tensor = _run(lambda x, ws, c: grouped_linear(x, ws, torch.tensor(c)), counts, torch.float32)
    _assert_close(as_tensor, _run(grouped_linear, counts, torch.float32), torch.float32)


def test_the_group_ends_are_a_cumulative_sum_on_the_inputs_device():
    ends = grouped_gemm.group_ends(torch.tensor([2, 0, 3]), torch.device("cpu"))
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 2, 5]
    assert grouped_gemm.group_ends([2, 0, 3], torch.device("cpu")).tolist() == [2, 2, 5]


def test_auto_loops_on_the_cpu_and_the_environment_overrides(monkeypatch):
    x32 = torch.zeros(4, 16)
    monkeypatch.delenv(ENV, raising=False)
    assert not use_grouped("auto", x32, 8)  # the CPU's kernel is slower than the loop
    monkeypatch.setenv(ENV, "grouped")
    assert use_grouped("auto", x32, 8) and use_grouped("loop", x32, 8)
    assert not use_grouped("auto", torch.zeros(4, 12, dtype=torch.bfloat16), 8)  # 24-byte rows: no kernel
    assert not use_grouped("auto", x32.double(), 8)
    assert not use_grouped("auto", torch.zeros(0, 16), 8)  # no rows: nothing to group
    monkeypatch.setenv(ENV, "loop")
    assert not use_grouped("auto", x32, 8)
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=ENV):
        use_grouped("auto", x32, 8)


def _module(cls, monkeypatch, experts=4, d_in=16, d_out=24, **kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sorl_megatron.bridge import local_spec

    tracker = types.SimpleNamespace(fork=lambda name: contextlib.nullcontext())
    monkeypatch.setattr(local_spec, "get_cuda_rng_tracker", lambda: tracker)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    pg = types.SimpleNamespace(expt_tp=None, ep=None, expt_dp=None)
    torch.manual_seed(0)
    return cls(experts, d_in, d_out, config=cfg, init_method=torch.nn.init.normal_, bias=False,
               skip_bias_add=False, pg_collection=pg, **kwargs)


@pytest.mark.parametrize("cls_name", ["LocalColumnParallelGroupedLinear", "LocalRowParallelGroupedLinear"])
def test_the_spec_modules_keep_their_parameters_and_run_one_kernel(monkeypatch, cls_name):
    from sorl_megatron.bridge import local_spec

    cls = getattr(local_spec, cls_name)
    grouped, looped = _module(cls, monkeypatch), _module(cls, monkeypatch, expert_gemm="loop")
    shapes = {k: tuple(v.shape) for k, v in grouped.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in looped.state_dict().items()}
    assert sorted(shapes) == [f"weight{i}" for i in range(4)]
    looped.load_state_dict(grouped.state_dict())  # a checkpoint of one loads into the other
    calls = {"n": 0}
    kernel = torch._grouped_mm

    def counting(*args, **kwargs):
        calls["n"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    monkeypatch.setenv(ENV, "grouped")
    x = torch.randn(16, 16)
    out, bias = grouped(x, [5, 0, 3, 8])
    assert bias is None and calls["n"] == 1  # one kernel for the four experts
    monkeypatch.delenv(ENV)
    assert torch.equal(out, looped(x, [5, 0, 3, 8])[0])
    assert calls["n"] == 1  # "loop" (and "auto" on the CPU) run no grouped kernel
    with pytest.raises(ValueError, match="expert_gemm must be one of"):
        _module(cls, monkeypatch, expert_gemm="fast")


def test_the_recipe_and_the_options_name_the_same_modes():
    from typing import get_args, get_type_hints

    from sorl_megatron.bridge.model import ModelOptions
    from sorl_megatron.trainer.recipe.config import ModelConfig

    assert get_args(get_type_hints(ModelConfig)["expert_gemm"]) == grouped_gemm.EXPERT_GEMMS
    assert ModelConfig().expert_gemm == ModelOptions().expert_gemm == "auto"
    with pytest.raises(ValueError, match="expert_gemm must be one of"):
        ModelOptions(expert_gemm="fast")


def _experts(monkeypatch, experts=4, hidden=16, ffn=8):
    """The spec's MoE experts module (megatron's grouped MLP with the local linears)."""
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sorl_megatron.bridge import local_spec

    tracker = types.SimpleNamespace(fork=lambda name: contextlib.nullcontext())
    monkeypatch.setattr(local_spec, "get_cuda_rng_tracker", lambda: tracker)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, use_cpu_initialization=True,
                            num_moe_experts=experts, moe_ffn_hidden_size=ffn, gated_linear_unit=True,
                            activation_func=F.silu, bias_activation_fusion=False, add_bias_linear=False)
    pg = types.SimpleNamespace(expt_tp=None, ep=None, expt_dp=None)
    sub = MLPSubmodules(linear_fc1=ModuleSpec(module=local_spec.LocalColumnParallelGroupedLinear),
                        linear_fc2=ModuleSpec(module=local_spec.LocalRowParallelGroupedLinear))
    torch.manual_seed(0)
    return local_spec.LocalGroupedMLP(experts, cfg, sub, pg_collection=pg)


def _host_reads(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"n": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            reads["n"] += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counting_tolist(t, *args, **kwargs):
        reads["n"] += 1
        return tolist(t, *args, **kwargs)

    torch.Tensor.tolist = counting_tolist
    try:
        with Count():
            out = fn()
    finally:
        torch.Tensor.tolist = tolist
    return out, reads["n"]


def test_the_experts_hand_the_routers_counts_through_without_reading_them(monkeypatch):
    """Megatron's grouped MLP reads its tokens per expert to the host (``tolist``) per layer; the
    spec's ``LocalGroupedMLP`` hands the device tensor to the linears: the grouped kernel reads
    nothing, the loop reads the counts once for both linears. Same numbers either way."""
    mlp = _experts(monkeypatch)
    counts = torch.tensor([5, 0, 3, 8])
    x, probs = torch.randn(16, 16), torch.rand(16)
    monkeypatch.setenv(ENV, "grouped")
    (grouped, _), reads_grouped = _host_reads(lambda: mlp(x, counts, probs))
    monkeypatch.setenv(ENV, "loop")
    (looped, _), reads_loop = _host_reads(lambda: mlp(x, counts, probs))
    assert reads_grouped == 0 and reads_loop == 1
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
