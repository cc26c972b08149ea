"""Megatron models built from tiny HF checkpoints on CPU: logits, weights, checkpoints.

Two worker launches hold all the cases: one `torchrun --nproc_per_node=2` (gloo) run and
one single-process run that also resumes the checkpoints the 2-process run saved. The
four-rank logits (TP2 x EP2) run worker.py's op_logits in tests/engine's four-process launch.
"""

from __future__ import annotations

import json
import os

import pytest

from sorl_megatron.bridge.dist_ckpt import check_dist_checkpoint
from sorl_megatron.bridge.families import FAMILIES, mtp_layers

from .cases import LOGIT_TOL, MP_CASES, SINGLE_CASES
from .harness import result


def _ids(cases, prefix):
    return [c["id"] for c in cases if c["id"].startswith(prefix)]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", _ids(MP_CASES, "logits/") + _ids(MP_CASES, "value/"))
def test_logits_match_transformers_2proc(mp_results, case_id):
    r = result(mp_results, case_id)
    assert r["max_abs_diff"] <= LOGIT_TOL, r
    assert r["shape"] == [2, 12, 1 if case_id.startswith("value/") else 128]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", _ids(SINGLE_CASES, "logits/") + _ids(SINGLE_CASES, "value/"))
def test_logits_match_transformers_1proc(single_results, case_id):
    r = result(single_results, case_id)
    assert r["max_abs_diff"] <= LOGIT_TOL, r
    assert r["shape"] == [2, 12, 1 if case_id.startswith("value/") else 128]


def _check_roundtrip(r: dict, model: str) -> None:
    model = {"deepseek_v3_3l": "deepseek_v3"}.get(model, model)  # a 3-layer variant for uneven PP
    assert r["missing"] == [] and r["extra"] == [], r
    assert r["unequal"] == [], r  # torch.equal, same dtype (the source cast to bf16 for bf16 exports)
    assert r["n_tensors"] > 10
    want_dtype = r["case"].get("dtype") or r["case"].get("expect_dtype", "float32")
    assert r["config_dtype"] == want_dtype
    expected_type = model if model in FAMILIES else "qwen2"  # qwen2_tied, qwen2_4l: variants of qwen2
    assert r["config_model_type"] == expected_type
    # an MTP module (DeepSeek-V3 / GLM-4.5: stored as layer num_hidden_layers) is skipped on load, not exported
    has_mtp = model in FAMILIES and mtp_layers(FAMILIES[model].tiny_config()) > 0
    assert bool(r["skipped_mtp"]) == has_mtp, r["skipped_mtp"]
    # tokenizer + generation files copied from the source directory
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= set(r["files"])


@pytest.mark.slow
@pytest.mark.parametrize("case_id", _ids(MP_CASES, "roundtrip/"))
def test_hf_roundtrip_is_tensor_equal_2proc(mp_results, case_id):
    _check_roundtrip(result(mp_results, case_id), case_id.split("/")[1])


@pytest.mark.slow
@pytest.mark.parametrize("case_id", _ids(SINGLE_CASES, "roundtrip/"))
def test_hf_roundtrip_is_tensor_equal_1proc(single_results, case_id):
    r = result(single_results, case_id)
    _check_roundtrip(r, case_id.split("/")[1])
    shards = [f for f in r["files"] if f.endswith(".safetensors")]
    if case_id.endswith("sharded"):
        assert len(shards) > 1 and "model.safetensors.index.json" in r["files"]
    else:
        assert shards == ["model.safetensors"] and "model.safetensors.index.json" not in r["files"]


@pytest.mark.slow
@pytest.mark.parametrize("which,case_id", [("mp", "from_config/mixtral/ep2"), ("single", "from_config/qwen3_moe/ws1")])
def test_random_init_model_exports_to_transformers(mp_results, single_results, which, case_id):
    r = result(mp_results if which == "mp" else single_results, case_id)
    assert r["logit_std"] > 1e-3  # not a degenerate (all-zero) model
    assert r["max_abs_diff"] <= LOGIT_TOL, r


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mp", "single"])
def test_streamed_buckets_are_bounded_and_complete(mp_results, single_results, which):
    results, case_id = (
        (mp_results, "buckets/qwen3_moe/ep2") if which == "mp" else (single_results, "buckets/qwen2_tied/ws1")
    )
    r = result(results, case_id)
    bound = r["case"]["bucket_bytes"]
    assert r["n_buckets"] > 2  # the bound actually split the stream
    assert r["oversize_multi"] == []  # only a single tensor larger than the bound may exceed it
    assert r["duplicates"] == 0 and r["missing"] == [] and r["unequal"] == []
    assert r["max_bucket_bytes"] <= max(bound, r["max_bucket_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mp", "single"])
def test_fp8_export_dequantizes_within_bound(mp_results, single_results, which):
    r = result(mp_results, "fp8/mixtral/tp2") if which == "mp" else result(single_results, "fp8/qwen3_moe/ws1")
    assert r["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }
    assert r["scale_dtypes"] == ["torch.float32"]
    assert r["worst_error_over_bound"] <= 1.0, r["worst_error_over_bound"]
    assert 0 < r["max_rel_fro_error"] < 0.05  # e4m3 on Gaussian weights: ~2-3 % relative
    fp8 = r["fp8_names"]
    assert any("self_attn.q_proj" in n for n in fp8) and any("o_proj" in n for n in fp8)
    assert any(".experts." in n for n in fp8)
    kept = r["kept_names"]
    # norms, embeddings, lm_head and routers stay in high precision, bit-equal
    assert "model.embed_tokens.weight" in kept and "lm_head.weight" in kept and "model.norm.weight" in kept
    assert any(n.endswith(".gate.weight") for n in kept)  # the router
    assert not any("norm" in n or n.endswith(".gate.weight") for n in fp8)
    assert r["kept_unequal"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "which,case_id",
    [("mp", c) for c in _ids(MP_CASES, "save/") + _ids(MP_CASES, "load/")]
    + [("single", c) for c in _ids(SINGLE_CASES, "load/")],
)
def test_megatron_checkpoint_resumes_at_other_layouts(mp_results, single_results, which, case_id):
    r = result(mp_results if which == "mp" else single_results, case_id)
    assert r["max_abs_diff"] <= LOGIT_TOL, r


@pytest.mark.slow
def test_checkpoint_layout_files(work_dir, mp_results):

    ck = work_dir / "ck_qwen3_moe_tp2"
    meta = json.loads((ck / "sorl_megatron.json").read_text())
    assert meta["saved_layout"]["tp"] == 2 and meta["world_size"] == 2 and meta["extra"] == {"step": 7}
    assert (ck / "model" / "metadata.json").is_file()
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(ck / "hf"))
    manifest = json.loads((ck / "MANIFEST.json").read_text())["files"]
    assert "model/.metadata" in manifest and "sorl_megatron.json" in manifest
    # the allow-lists cover what real checkpoints (TP, EP, PP+VPP, MoE) contain
    for saved in work_dir.glob("ck_*"):
        check_dist_checkpoint(str(saved / "model"))


@pytest.mark.slow
def test_missing_weight_names_the_tensor(single_results):
    r = result(single_results, "missing_weight/qwen2")
    assert r["error_type"] == "CheckpointFileError"
    assert "model.layers.1.mlp.up_proj.weight" in r["error"] and "broken_qwen2" in r["error"]


@pytest.mark.slow
def test_local_spec_has_te_parameter_names_and_te_is_used_when_present(single_results):
    r = result(single_results, "spec_selection")
    assert r["te_available_here"] is False  # CPU-only machine
    assert r["picked_with_te"] == "te-spec" and r["te_flag_calls"] == [True]
    names = set(r["param_names"])
    layer = "decoder.layers.0."
    expected = {
        layer + "self_attention.linear_qkv.layer_norm_weight",  # input norm fused into QKV (TE naming)
        layer + "self_attention.linear_qkv.weight",
        layer + "self_attention.q_layernorm.weight",
        layer + "self_attention.k_layernorm.weight",
        layer + "self_attention.linear_proj.weight",
        layer + "pre_mlp_layernorm.weight",  # MoE layers keep a separate norm, as in TE's spec
        layer + "mlp.router.weight",
        *(f"{layer}mlp.experts.linear_fc1.weight{i}" for i in range(4)),  # TE grouped-linear names
        *(f"{layer}mlp.experts.linear_fc2.weight{i}" for i in range(4)),
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    }
    assert expected <= names, sorted(expected - names)
    assert not any("input_layernorm" in n or "local_experts" in n for n in names)


@pytest.mark.slow
def test_fp8_export_quantizes_mla_projections(single_results):
    r = result(single_results, "fp8/deepseek_v3/ws1")
    assert r["worst_error_over_bound"] <= 1.0 and r["kept_unequal"] == []
    fp8 = r["fp8_names"]
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts.down_proj"):
        assert any(f"self_attn.{proj}" in n or f"mlp.{proj}" in n for n in fp8), proj
    kept = r["kept_names"]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in kept  # the routing bias stays exact
    assert "model.layers.0.self_attn.q_a_layernorm.weight" in kept and "model.layers.1.mlp.gate.weight" in kept


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2_moe", "glm4_moe"])
def test_fp8_export_of_shared_expert_families(single_results, model):
    """Routed and shared experts and attention go to FP8 blocks; routers, the routing bias
    (GLM-4.5) and Qwen2-MoE's one-row shared-expert gate stay in high precision, bit-equal, as
    SGLang's FP8 loaders read them unquantized."""
    r = result(single_results, f"fp8/{model}/ws1")
    assert r["worst_error_over_bound"] <= 1.0 and r["kept_unequal"] == []
    fp8, kept = r["fp8_names"], r["kept_names"]
    shared = "shared_expert." if model == "qwen2_moe" else "shared_experts."
    moe_layer = 0 if model == "qwen2_moe" else 1  # GLM-4.5's first layer is dense
    for piece in ("self_attn.q_proj", "self_attn.o_proj", f"mlp.{shared}down_proj", "mlp.experts.0.up_proj"):
        assert any(f"layers.{moe_layer}.{piece}" in n for n in fp8), piece
    assert f"model.layers.{moe_layer}.mlp.gate.weight" in kept
    if model == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert_gate.weight" in kept
    else:
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in kept


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek_v3", "deepseek_v3_yarn", "qwen2_moe", "glm4_moe"])
def test_each_family_fix_is_needed(single_results, model):
    """Undoing any TransformerConfig field a family spec sets (or zeroing the loaded expert-score
    bias) moves the logits far from transformers': the tiny configs exercise every fix."""
    r = result(single_results, f"family_fixes/{model}")
    assert r["diffs"] and all(d > 1e-3 for d in r["diffs"].values()), r["diffs"]
    assert r["n_expert_bias"] == (0 if model == "qwen2_moe" else 1)
    if model == "deepseek_v3_yarn":  # mbridge alone would build plain RoPE: logits far off
        assert r["diffs"]['{"rope_type": "rope", "rotary_scaling_factor": 1.0}'] > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("case_id", [c["id"] for c in MP_CASES if c["op"] == "uneven_logits"])
def test_uneven_pipeline_stages_hold_the_configured_layers(mp_results, case_id):
    """first_stage_layers / last_stage_layers reach megatron: each rank built the global layers
    the layout names (HF's numbering, through mbridge), and the logits above match transformers."""
    r = result(mp_results, case_id)
    assert r["layers_by_rank"] == r["case"]["expect_layers"]
    assert r["max_abs_diff"] <= LOGIT_TOL, r


@pytest.mark.slow
def test_uneven_split_rules_agree_with_megatron(single_results):
    """Over a grid of (layers, PP, VPP, first, last), every split the layout checks accept is
    placed by megatron exactly as ParallelLayout.stage_layers predicts, and every split megatron
    refuses (or builds with an empty or overlapping stage) is refused by the checks."""
    r = result(single_results, "pipeline_split_grid")
    assert r["mismatches"] == [] and r["accepted_refused"] == []
    assert r["counts"]["both_accept"] > 100 and r["counts"]["both_refuse"] > 100  # the grid covers both sides
    # stricter than megatron only where it would silently drop last_stage_layers: PP=2 with both
    # given and first + last != layers (megatron is given `first` alone there, see layout.py)
    assert all("PP=2 (first" in e and ", last" in e for e in r["extra_refusals"]), r["extra_refusals"]
