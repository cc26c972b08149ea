"""Block FP8 quantization math (no megatron needed)."""

from __future__ import annotations

import pytest
import torch

from sorl_megatron.common.fp8 import (
    FP8_DTYPE,
    dequantize_block_fp8,
    dequantize_hf_state_dict,
    is_fp8_target,
    quantize_block_fp8,
    quantize_hf_tensor,
)


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (64, 48), (1, 257)])
def test_roundtrip_error_bound(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns spanning 4 decades
    q, s = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = dequantize_block_fp8(q, s)
    block_scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = w.abs() * 2.0**-4 + block_scale * 2.0**-10
    assert ((deq - w).abs() <= bound).all()
    # each block's largest magnitude maps to the top of the e4m3 range
    assert q.float().abs().max() == 448.0


def test_scale_is_per_block():
    w = torch.ones(256, 256)
    w[:128, 128:] *= 1000.0
    q, s = quantize_block_fp8(w)
    assert torch.allclose(s, torch.tensor([[1.0, 1000.0], [1.0, 1.0]]) / 448.0)
    assert torch.equal(dequantize_block_fp8(q, s), w)  # powers of two times 448/448 are exact


def test_zero_block_and_bad_scale_shape():
    w = torch.zeros(130, 10)
    q, s = quantize_block_fp8(w)
    assert torch.equal(dequantize_block_fp8(q, s), w)
    with pytest.raises(ValueError, match="does not match weight"):
        dequantize_block_fp8(q, torch.ones(1, 1))
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_block_fp8(torch.ones(3))


def test_which_tensors_are_quantized():
    w = torch.randn(8, 8)
    yes = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.experts.2.down_proj.weight",
        "model.layers.1.block_sparse_moe.experts.0.w3.weight",
        "model.layers.1.mlp.shared_expert.up_proj.weight",
    ]
    no = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate.weight",  # router
        "model.layers.0.block_sparse_moe.gate.weight",  # router
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ]
    assert all(is_fp8_target(n, w) for n in yes)
    assert not any(is_fp8_target(n, w) for n in no)
    assert not is_fp8_target("model.layers.0.self_attn.q_proj.bias", torch.randn(8))


def test_state_dict_helpers():
    w = torch.randn(16, 16)
    state = dict(quantize_hf_tensor("model.layers.0.self_attn.q_proj.weight", w))
    assert set(state) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv"}
    state["model.norm.weight"] = torch.ones(16)
    back = dequantize_hf_state_dict(state)
    assert set(back) == {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}
    assert (back["model.layers.0.self_attn.q_proj.weight"] - w).abs().max() < w.abs().max() / 16
    del state["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    with pytest.raises(KeyError, match="has no"):
        dequantize_hf_state_dict(state)


@pytest.mark.parametrize("shape", [(256, 384), (7168, 2048), (129, 1), (1, 200), (300, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_meta_weight_quantizes_to_the_shapes_and_dtypes_of_a_real_one(shape, dtype):
    """The sync planner quantizes full-size models on the meta device: there the pair is built
    from the shapes alone (running the block math on meta cost 9 ms a tensor, most of the
    planner's time). It must be the pair the real quantization makes."""
    real_q, real_s = quantize_block_fp8(torch.randn(shape).to(dtype))
    meta_q, meta_s = quantize_block_fp8(torch.empty(shape, dtype=dtype, device="meta"))
    for real, meta in ((real_q, meta_q), (real_s, meta_s)):
        assert meta.is_meta
        assert (meta.shape, meta.dtype, meta.is_contiguous()) == (real.shape, real.dtype, real.is_contiguous())
