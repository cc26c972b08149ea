"""Runs a list of Megatron checks in one process group and writes their results as JSON.

Launched by the tests, single-process (`python worker.py spec.json out.json`) or with
`torchrun --nproc_per_node=2`: importing megatron and starting a process group costs ~10 s,
so many checks share one launch. Each check reports numbers; pytest asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from case_runner import run_cases  # noqa: E402
from tiny_models import hf_logits  # noqa: E402

from sorl_megatron.bridge import (  # noqa: E402
    ModelOptions,
    ParallelLayout,
    build_model,
    forward_logits,
    iter_hf_weight_buckets,
    load_megatron_checkpoint,
    save_hf_checkpoint,
    save_megatron_checkpoint,
)
from sorl_megatron.common.fp8 import FP8_DTYPE, dequantize_block_fp8  # noqa: E402

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def rank() -> int:
    return torch.distributed.get_rank()


def read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


_HF_LOGITS: dict[str, torch.Tensor] = {}


def reference_logits(model_dir: str) -> torch.Tensor:
    if model_dir not in _HF_LOGITS:
        _HF_LOGITS[model_dir] = hf_logits(model_dir, TOKENS)
    return _HF_LOGITS[model_dir]


def op_logits(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]))
    logits = forward_logits(model, TOKENS)
    ref = reference_logits(src)
    return {"max_abs_diff": (logits - ref).abs().max().item(), "shape": list(logits.shape)}


def op_value(case: dict, models: str, work: str) -> dict:
    """Critic head set to lm_head row 0: its values must equal the HF logits of token 0.
    (A tied model's critic is built untied, so its backbone must still load correctly.)"""
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]), ModelOptions(value_head=True))
    state = read_safetensors_dir(src)
    lm_head = state.get("lm_head.weight", state["model.embed_tokens.weight"])  # tied: the embedding
    heads = [c.output_layer for c in model.unwrapped() if getattr(c, "post_process", False)]
    for head in heads:
        with torch.no_grad():
            head.weight.copy_(lm_head[:1])
    values = forward_logits(model, TOKENS)
    ref = reference_logits(src)[..., :1]
    return {"max_abs_diff": (values - ref).abs().max().item(), "shape": list(values.shape)}


def _beyond_last_layer(name: str, num_layers: int) -> bool:
    """A DeepSeek-V3 MTP tensor: stored as layer index >= num_hidden_layers."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers


def _compare_dirs(out_dir: str, src: str, dtype=None) -> dict:
    got, want = read_safetensors_dir(out_dir), read_safetensors_dir(src)
    with open(os.path.join(src, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    skipped = sorted(k for k in want if _beyond_last_layer(k, num_layers))  # MTP: not loaded, not exported
    want = {k: v for k, v in want.items() if k not in skipped}
    if dtype is not None:
        want = {k: v.to(dtype) for k, v in want.items()}
    unequal = [k for k in want if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    files = sorted(os.listdir(out_dir))
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    return {
        "missing": sorted(set(want) - set(got)),
        "extra": sorted(set(got) - set(want)),
        "unequal": unequal,
        "n_tensors": len(got),
        "files": files,
        "config_dtype": cfg.get("dtype"),
        "config_model_type": cfg.get("model_type"),
        "skipped_mtp": skipped,
    }


def op_roundtrip(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]))
    out_dir = os.path.join(work, f"rt_{case['model']}_{case['layout'].replace(',', '_').replace('=', '')}")
    t = time.time()
    dtype = getattr(torch, case["dtype"]) if "dtype" in case else None
    if dtype is not None:
        out_dir += "_" + case["dtype"]
    save_hf_checkpoint(model, out_dir, dtype=dtype, max_shard_bytes=case.get("max_shard_bytes", 4 * 1024**3))
    res = {"save_s": time.time() - t}
    if rank() == 0:
        res.update(_compare_dirs(out_dir, src, dtype))
    return res


# TransformerConfig fields the family specs set (sorl_megatron/bridge/families/), and what megatron
# would compute without them: each must move the logits away from transformers' (a fix that
# changes nothing is not needed).
FAMILY_FIXES = {
    "deepseek_v3_yarn": [{"rope_type": "rope", "rotary_scaling_factor": 1.0}],  # YaRN (mbridge: plain RoPE)
    "deepseek_v3": [
        {"moe_router_num_groups": None, "moe_router_group_topk": None},  # group-limited top-k
        {"moe_router_topk_scaling_factor": None},  # routed_scaling_factor
        {"moe_shared_expert_intermediate_size": None},  # shared expert
    ],
    "glm4_moe": [
        {"moe_router_topk_scaling_factor": None},
    ],
    "qwen2_moe": [
        {"moe_shared_expert_gate": False},  # sigmoid-gated shared expert
        {"moe_router_pre_softmax": False},  # norm_topk_prob=False: no top-k renormalization
    ],
}


def op_family_fixes(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    ref = reference_logits(src)
    diffs = {}
    for over in FAMILY_FIXES[case["model"]]:
        # Without a fix the model may leave checkpoint tensors unused (no shared expert), which
        # build_model refuses: load with mbridge alone, unchecked, to see what the fix changes.
        model = build_model(src, ParallelLayout(), ModelOptions(config_overrides=dict(over)), load_weights=False)
        with torch.no_grad():
            model.bridge.load_weights(model.chunks, src)
        diffs[json.dumps(over, sort_keys=True)] = (forward_logits(model, TOKENS) - ref).abs().max().item()
    model = build_model(src, ParallelLayout())
    expert_bias = [m for c in model.unwrapped() for n, m in c.named_buffers() if n.endswith("expert_bias")]
    if expert_bias:  # the loaded expert-score correction bias takes part in routing
        for b in expert_bias:
            b.zero_()
        diffs["zero_expert_bias"] = (forward_logits(model, TOKENS) - ref).abs().max().item()
    return {"diffs": diffs, "n_expert_bias": len(expert_bias)}


def op_from_config(case: dict, models: str, work: str) -> dict:
    """Random-init model from a config object (no HF files): exported, it must load in
    transformers and give the Megatron logits."""
    from tiny_models import CONFIGS

    model = build_model(CONFIGS[case["model"]](), ParallelLayout.from_string(case["layout"]), load_weights=False)
    logits = forward_logits(model, TOKENS)
    out_dir = os.path.join(work, f"from_config_{case['model']}")
    save_hf_checkpoint(model, out_dir)
    if rank() != 0:
        return {}
    ref = hf_logits(out_dir, TOKENS)
    return {"max_abs_diff": (logits - ref).abs().max().item(), "logit_std": logits.std().item()}


def op_buckets(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]))
    want = read_safetensors_dir(src)
    bound = case["bucket_bytes"]
    sizes, names, unequal, oversize = [], [], [], []
    for bucket in iter_hf_weight_buckets(model, bucket_bytes=bound):
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        sizes.append(nbytes)
        if nbytes > bound and len(bucket) > 1:
            oversize.append(nbytes)
        for name, tensor in bucket:
            names.append(name)
            if name not in want or not torch.equal(tensor, want[name]):
                unequal.append(name)
    return {
        "n_buckets": len(sizes),
        "max_bucket_bytes": max(sizes),
        "oversize_multi": oversize,
        "duplicates": len(names) - len(set(names)),
        "missing": sorted(set(want) - set(names)),
        "unequal": unequal,
    }


def op_fp8(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]))
    out_dir = os.path.join(work, f"fp8_{case['model']}")
    save_hf_checkpoint(model, out_dir, fp8=True)
    if rank() != 0:
        return {}
    got, want = read_safetensors_dir(out_dir), read_safetensors_dir(src)
    with open(os.path.join(out_dir, "config.json")) as f:
        out_cfg = json.load(f)
    qcfg = out_cfg.get("quantization_config")
    want = {k: v for k, v in want.items() if not _beyond_last_layer(k, out_cfg["num_hidden_layers"])}
    fp8_names = sorted(k for k, v in got.items() if v.dtype == FP8_DTYPE)
    worst_ratio = 0.0  # |error| / allowed bound, must stay <= 1
    max_rel = 0.0
    for name in fp8_names:
        w = want[name].float()
        scale = got[f"{name}_scale_inv"]
        deq = dequantize_block_fp8(got[name], scale)
        block_scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        # e4m3 keeps 3 mantissa bits: round-to-nearest error <= |w| * 2^-4 for normal values and
        # <= half the subnormal spacing (2^-10 * scale) near zero.
        bound = w.abs() * 2.0**-4 + block_scale * 2.0**-10 + 1e-12
        worst_ratio = max(worst_ratio, ((deq - w).abs() / bound).max().item())
        max_rel = max(max_rel, ((deq - w).norm() / w.norm()).item())
    kept = [k for k in want if k not in fp8_names]
    kept_unequal = [k for k in kept if not torch.equal(got[k], want[k])]
    return {
        "quantization_config": qcfg,
        "fp8_names": fp8_names,
        "kept_names": kept,
        "kept_unequal": kept_unequal,
        "worst_error_over_bound": worst_ratio,
        "max_rel_fro_error": max_rel,
        "scale_dtypes": sorted({str(got[f'{n}_scale_inv'].dtype) for n in fp8_names}),
    }


def op_save_ckpt(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]))
    ckpt = os.path.join(work, case["ckpt"])
    save_megatron_checkpoint(model, ckpt, extra={"step": 7})
    logits = forward_logits(model, TOKENS)
    return {"max_abs_diff": (logits - reference_logits(src)).abs().max().item()}


def op_load_ckpt(case: dict, models: str, work: str) -> dict:
    src = os.path.join(models, case["model"])
    ckpt = os.path.join(case.get("ckpt_root", work), case["ckpt"])
    model = load_megatron_checkpoint(ckpt, ParallelLayout.from_string(case["layout"]))
    logits = forward_logits(model, TOKENS)
    return {"max_abs_diff": (logits - reference_logits(src)).abs().max().item()}


def op_missing_weight(case: dict, models: str, work: str) -> dict:
    """Drop one tensor from a copy of the checkpoint: loading must name it."""
    from safetensors.torch import save_file
    from tiny_models import copy_model_dir

    src = os.path.join(models, case["model"])
    broken = os.path.join(work, "broken_" + case["model"])
    if rank() == 0:
        copy_model_dir(src, broken)
        state = read_safetensors_dir(src)
        state.pop(case["drop"])
        save_file(state, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    torch.distributed.barrier()
    try:
        build_model(broken, ParallelLayout.from_string(case["layout"]))
    except Exception as e:  # the test asserts on type and message
        return {"error_type": type(e).__name__, "error": str(e)}
    return {"error_type": None, "error": None}


def op_spec_selection(case: dict, models: str, work: str) -> dict:
    """TE spec iff TE imports (mocked: TE cannot be installed on these CPUs); the local spec's
    parameter names are TE's."""
    from unittest import mock

    from sorl_megatron.bridge import local_spec

    model = build_model(os.path.join(models, case["model"]), ParallelLayout(), load_weights=False)
    names = sorted(n for c in model.unwrapped() for n, _ in c.named_parameters())
    calls = []

    def fake_te_spec(config, use_transformer_engine, **kwargs):
        calls.append(use_transformer_engine)
        return "te-spec" if use_transformer_engine else local_spec.get_gpt_decoder_block_spec.__wrapped_original__(
            config, use_transformer_engine, **kwargs)

    fake_te_spec.__wrapped_original__ = local_spec.get_gpt_decoder_block_spec
    with mock.patch.object(local_spec, "transformer_engine_available", lambda: True), mock.patch.object(
        local_spec, "get_gpt_decoder_block_spec", fake_te_spec
    ):
        picked_with_te = local_spec.decoder_block_spec(model.config)
    return {
        "te_available_here": local_spec.transformer_engine_available(),
        "picked_with_te": picked_with_te,
        "te_flag_calls": calls,
        "param_names": names,
    }


def op_compat_probes(case: dict, models: str, work: str) -> dict:
    from compat_probes import run_probes

    return run_probes()


def op_local_attention(case: dict, models: str, work: str) -> dict:
    """The TE-less spec's two core attentions (torch SDPA, megatron's unfused math) on the same
    inputs: grouped KV heads, the engine's causal mask, no mask, packed THD segments; outputs and
    input gradients. Then which settings send the SDPA module back to the unfused path."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from sorl_megatron.bridge import init_parallel
    from sorl_megatron.bridge.cpu_modes import CudaDeviceToCpu
    from sorl_megatron.bridge.forward import causal_attention_mask
    from sorl_megatron.bridge.local_spec import LOCAL_ATTENTION

    if not parallel_state.model_parallel_is_initialized():
        init_parallel(ParallelLayout())  # megatron's groups and the CPU stand-ins (its dropout RNG)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                            use_cpu_initialization=True, attention_dropout=0.0)
    mods = {k: cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            for k, cls in LOCAL_ATTENTION.items()}
    g = torch.Generator().manual_seed(0)
    s, b = 37, 3
    q, k, v = (torch.randn(s, b, h, 8, generator=g) for h in (8, 2, 2))
    lengths = [5, 12, 1, 19]  # packed: one row of 37 tokens, segments of four length classes
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=19, max_seqlen_kv=19)
    inputs = {
        "mask": ((q, k, v), causal_attention_mask(s, "cpu"), None),
        "no_mask": ((q, k, v), None, None),
        "packed": ((q[:, 0], k[:, 0], v[:, 0]), None, packed),
    }
    out: dict = {}
    for name, (qkv, mask, pack) in inputs.items():
        res = {}
        for kind, mod in mods.items():
            leaves = [x.clone().requires_grad_(True) for x in qkv]
            with CudaDeviceToCpu():  # as the engine runs megatron on the CPU (its default causal mask)
                y = mod(*leaves, mask, packed_seq_params=pack)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            res[kind] = (y.detach(), [x.grad for x in leaves])
        (ya, ga), (yb, gb) = res["sdpa"], res["unfused"]
        out[name] = {"shape": list(ya.shape), "shape_unfused": list(yb.shape), "out": (ya - yb).abs().max().item(),
                     "grad": max((a - c).abs().max().item() for a, c in zip(ga, gb)),
                     "scale": yb.abs().max().item()}
    # the engine's causal mask and no mask (the mask type's) are one function on both paths
    out["mask_vs_none"] = (mods["sdpa"](q, k, v, causal_attention_mask(s, "cpu"))
                           - mods["sdpa"](q, k, v, None)).abs().max().item()
    sdpa = mods["sdpa"]
    supported = {"plain": sdpa._sdpa_supported(None)}
    sdpa.attention_dropout.p = 0.1
    sdpa.train()
    supported["dropout_training"] = sdpa._sdpa_supported(None)
    sdpa.eval()
    supported["dropout_eval"] = sdpa._sdpa_supported(None)
    sdpa.attention_dropout.p = 0.0
    supported["bias"] = sdpa._sdpa_supported(torch.zeros(1))
    out["supported"] = supported
    out["kinds"] = sorted(LOCAL_ATTENTION)
    return out


def op_pipeline_split_grid(case: dict, models: str, work: str) -> dict:
    from pipeline_split_grid import run_grid

    return run_grid()


def op_uneven_logits(case: dict, models: str, work: str) -> dict:
    """Logits vs transformers at an uneven PP layout, and the global layer ids each rank built."""
    src = os.path.join(models, case["model"])
    model = build_model(src, ParallelLayout.from_string(case["layout"]))
    logits = forward_logits(model, TOKENS)
    mine = [[layer.layer_number - 1 for layer in chunk.decoder.layers] for chunk in model.unwrapped()]
    by_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(by_rank, mine)
    diff = (logits - reference_logits(src)).abs().max().item()
    return {"max_abs_diff": diff, "shape": list(logits.shape), "layers_by_rank": by_rank}


OPS = {
    "pipeline_split_grid": op_pipeline_split_grid,
    "uneven_logits": op_uneven_logits,
    "logits": op_logits,
    "value": op_value,
    "from_config": op_from_config,
    "roundtrip": op_roundtrip,
    "buckets": op_buckets,
    "fp8": op_fp8,
    "save_ckpt": op_save_ckpt,
    "load_ckpt": op_load_ckpt,
    "missing_weight": op_missing_weight,
    "compat_probes": op_compat_probes,
    "local_attention": op_local_attention,
    "family_fixes": op_family_fixes,
    "spec_selection": op_spec_selection,
}


def main() -> None:
    run_cases(OPS, default_timeout_s=180)


if __name__ == "__main__":
    main()
