"""The Megatron RL engine on CPU/gloo: every layout equals world size 1.

Three launches: one single-process (the references), one `torchrun --nproc_per_node=2` that
re-initializes megatron at TP=2(+SP), EP=2, PP=2, PP=2 x VPP=2, TP=2 x ETP=1 x EP=2 and DP=2
in turn, and one of four processes (TP2 x EP2, TP2 x ETP1 x EP4; and there issue 20's families'
logits vs transformers at TP2 x EP2, the bridge tests' one check). Nothing is mocked:
the only thing missing here is a GPU, which cpu_compat stands in for.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.bridge.cases import LOGIT_TOL

TOL = 1e-5


def _ok(results, tag):
    r = results[tag]
    assert r["ok"], f"{tag} failed: {r.get('error')}\n{r.get('traceback', '')}"
    return r


def _load(work, tag):
    return torch.load(os.path.join(work, f"{tag}.pt"), weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------- world size 1 semantics


def test_clip_bias_factor_over_micro_batches_equals_whole_mini_batch(ws1, engine_work):
    r = _ok(ws1, "actor_ws1")
    # step 1: logprob mode, 4 micro-batches of 2 rows vs compute_policy_loss on all 8 rows
    assert r["m1"]["clip_bias/norm"] == pytest.approx(r["direct_1"]["logprob"], rel=1e-6)
    assert r["m1"]["clip_bias/factor"] == pytest.approx(1 / max(r["direct_1"]["logprob"], 0.05), rel=1e-6)
    # step 3: scalar mode (applied to the LR)
    assert r["m3"]["clip_bias/norm"] == pytest.approx(r["direct_3"]["scalar"], rel=1e-6)
    assert r["m3"]["lr"] == pytest.approx(1e-3 * r["m3"]["clip_bias/factor"], rel=1e-6)
    assert r["m1"]["lr"] == pytest.approx(0.5e-3)  # warm-up: step 1 of 2
    assert r["m1"]["clip_bias/factor"] > 1  # normalization is active in this batch


def test_the_default_placement_scales_the_update_by_the_factor(ws1):
    """Under Adam and clip_grad only the LR placement changes the parameter update by the
    factor; on the gradient (before or after clipping) Adam's normalization undoes it."""
    from sorl_megatron.algorithms.config import ClipBiasConfig, PolicyLossConfig

    # the placement that acts is the one a recipe gets without asking
    assert ClipBiasConfig().apply_to == PolicyLossConfig().clip_bias.apply_to == "lr"
    r = _ok(ws1, "placement_ws1")
    base, factor = r["base"]["update_norm"], r["lr"]["clip_bias/factor"]
    print({k: (r[k]["update_norm"] / base, r[k]["grad_norm"]) for k in ("lr", "clipped_grad", "grad")}, factor)
    assert r["lr"]["clip_bias/logprob_norm"] > 1e-4  # ||C|| > delta: the normalization acts on this batch
    assert abs(factor - 1) > 0.1
    assert r["lr"]["update_norm"] / base == pytest.approx(factor, rel=1e-4)
    assert (r["lr"]["clip_bias/lr_scale"], r["lr"]["clip_bias/grad_scale"]) == (pytest.approx(factor), 1.0)
    assert r["clipped_grad"]["clip_bias/grad_scale"] == pytest.approx(factor)
    for inert in ("clipped_grad", "grad"):  # the same batch and weights give the same factor
        assert r[inert]["clip_bias/factor"] == pytest.approx(factor, rel=1e-6)
        assert abs(r[inert]["update_norm"] / base - 1) < abs(factor - 1) / 4, inert


def test_param_grad_norm_equals_direct_autograd(ws1):
    r = _ok(ws1, "actor_ws1")
    assert r["m2"]["clip_bias/norm"] == pytest.approx(r["direct_pg_2"], rel=1e-5)
    assert r["direct_pg_2"] > 0


def test_update_diagnostics_equal_a_direct_forward(ws1):
    r = _ok(ws1, "diagnostics_ws1")
    m, d = r["m_plain"], r["direct"]
    assert m["steps"] == 1  # one mini-batch: the update's diagnostics are those of one forward
    for key in ("advantage/mean", "advantage/var", "clip_frac_high", "clip_frac_low", "approx_kl_k1",
                "approx_kl_k3", "abs_log_ratio/p50", "abs_log_ratio/p90", "abs_log_ratio/p99", "abs_log_ratio/max",
                "entropy/mean", "turn_ratio/spread"):
        assert m[key] == pytest.approx(d[key], rel=1e-5, abs=1e-7), key
    assert d["clip_frac_high"] > 0 and d["clip_frac_low"] > 0 and d["rows"] > 0 and d["advantage/var"] > 0
    assert m["abs_log_ratio/p50"] == pytest.approx(d["exact_p50"], rel=0.13)  # within one bin of torch.quantile
    assert r["hist_num"] == d["policy_tokens"]  # the TensorBoard histogram holds every policy token once
    assert "turn_ratio/spread_sum" not in m and "clip_bias/param_norm" not in m
    # grad_norm is the norm before clipping (clip_grad = 1e-3 here), for a loss without normalization
    assert m["grad_norm"] == pytest.approx(r["direct_grad_norm"], rel=1e-5) and m["grad_norm"] > 1e-2


def test_clip_bias_diagnostics_measure_param_norm_for_any_loss_and_leave_the_update(ws1):
    r = _ok(ws1, "diagnostics_ws1")
    assert r["m_diag"]["clip_bias/param_norm"] == pytest.approx(r["direct_pg_norm"], rel=1e-5)
    assert r["direct_pg_norm"] > 0 and r["m_diag"]["clip_bias/factor"] == 1.0
    assert r["param_diff"] == 0.0  # the second backward leaves the grpo update exactly as it was
    assert r["m_diag"]["loss"] == r["m_plain"]["loss"]
    # a mini-batch that clipped nothing has C = 0 exactly and costs no second pass
    assert r["m_on_policy"]["clip_bias/param_norm"] == 0.0 and r["m_on_policy"]["clip_frac"] == 0.0
    assert r["on_policy_passes"] == 1


@pytest.mark.parametrize("tag", ["old_from_forward_ws1", "old_from_forward_r3_ws1", "old_from_forward_dp2",
                                 "old_from_forward_pp2", "old_from_forward_r3_ep2"])
def test_the_first_mini_batch_takes_its_old_logprobs_from_its_forward(ws1, ws2, tag):
    r = _ok(ws1 if tag.endswith("ws1") else ws2, tag)
    # two epochs of two shuffled mini-batches: the first one's rows are not the batch's first rows
    assert r["steps"] == 4 and r["first"] != [0, 1, 2, 3] and sorted(r["first"] + r["rest"]) == list(range(8))
    assert r["factor"] != 1.0  # SO-GRPO's factor engaged: its second backward read pi_old as well
    # The same old log-probs and update as after a full old pass, to float32 rounding. Bit for bit
    # on some CPUs, not on others: a row's result can depend on which rows share its micro-batch
    # (an expert's GEMM has as many rows as tokens routed to it), and the update's shuffled
    # micro-batches are not the old pass's (docs/concepts/engine.md). 1e-2 of the update's own size is far
    # below what a wrong substitution moves (every ratio of the first mini-batch off 1).
    assert r["kept_diff"] <= 1e-5 and r["rest_diff"] <= 1e-5
    assert r["param_step"] > 1e-4 and r["param_diff"] <= 1e-2 * r["param_step"], (r["param_diff"], r["param_step"])
    assert r["m_plain"].keys() == r["m_reusing"].keys()
    for key, value in r["m_plain"].items():
        assert r["m_reusing"][key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
    assert r["kept_elsewhere"] == 0.0 and r["skipped_rows"] == 0.0  # the old pass forwarded only the rest
    e = r["errors"]
    assert "[3, 4, 6, 7] are not in the update's first mini-batch" in e["outside"]  # the split at step 4
    assert "shape (8,)" in e["shape"] and "(7,)" in e["shape"] and "torch.float32" in e["dtype"]
    assert e["outside_param_diff"] == e["shape_param_diff"] == e["dtype_param_diff"] == 0.0  # refused before a step


def test_every_loss_runs_and_matches_across_layouts(ws1, ws2, engine_work):
    from sorl_megatron.algorithms import POLICY_LOSSES

    _ok(ws1, "losses_ws1")
    _ok(ws2, "losses_ep2")
    ref, got = _load(engine_work, "losses_ws1"), _load(engine_work, "losses_ep2")
    for name in POLICY_LOSSES:
        for key in ("loss", "grad_norm", "clip_bias/factor"):
            assert got[name][key] == pytest.approx(ref[name][key], rel=1e-4, abs=1e-6), (name, key)
        assert ref[name]["grad_norm"] > 0, name
    assert _max_diff(ref["params"], got["params"]) < TOL


# ---------------------------------------------------------------- layouts vs world size 1


@pytest.mark.parametrize("tag", ["actor_tp2", "actor_ep2", "actor_pp2", "actor_dp2", "actor_dp2_distopt"])
def test_actor_layout_equals_world_size_1(ws1, ws2, engine_work, tag):
    _ok(ws1, "actor_ws1")
    r = _ok(ws2, tag)
    ref, got = _load(engine_work, "actor_ws1"), _load(engine_work, tag)
    assert (ref["logprobs"] - got["logprobs"]).abs().max() < TOL
    assert (ref["entropy"] - got["entropy"]).abs().max() < TOL
    assert _max_diff(ref["params_1"], got["params_1"]) < TOL
    assert _max_diff(ref["params_3"], got["params_3"]) < TOL
    for m in ("m1", "m2", "m3"):
        for key in ("loss", "clip_bias/norm", "clip_bias/factor", "grad_norm", "clip_frac", "kl_ref", "entropy"):
            assert got[m][key] == pytest.approx(ref[m][key], rel=1e-5, abs=1e-6), (m, key)
    # the factor at every layout equals the one on the concatenated mini-batch
    assert r["m1"]["clip_bias/norm"] == pytest.approx(r["direct_1"]["logprob"], rel=1e-5)


# (launch, tag, world-size-1 reference): log-probs, entropy and one update to 1e-6
MORE_LAYOUTS = [
    ("ws2", "actor_tp2_etp1_ep2", "actor_ws1"),  # TP 2 x ETP 1 x EP 2: expert TP != TP
    ("ws2", "actor_4l_pp2_vpp2", "actor_4l_ws1"),  # PP 2 x VPP 2: the interleaved 1F1B schedule
    ("ws2", "actor_4l_pp2_first1", "actor_4l_ws1"),  # uneven PP: 1 + 3 layers (parallelism.first_stage_layers)
    ("ws4", "actor_tp2_ep2_4r", "actor_ws1"),  # TP 2 x EP 2 x DP 2 (ETP 2, expert-DP 1)
    ("ws4", "actor_tp2_etp1_ep4_4r", "actor_ws1"),  # TP 2 x DP 2, experts ETP 1 x EP 4
]


@pytest.mark.parametrize("launch,tag,ref_tag", MORE_LAYOUTS, ids=[t for _, t, _ in MORE_LAYOUTS])
def test_expert_and_virtual_pipeline_layouts_equal_world_size_1(request, ws1, engine_work, launch, tag, ref_tag):
    _ok(ws1, ref_tag)
    _ok(request.getfixturevalue(launch), tag)
    ref, got = _load(engine_work, ref_tag), _load(engine_work, tag)
    assert (ref["logprobs"] - got["logprobs"]).abs().max() <= 1e-6
    assert (ref["entropy"] - got["entropy"]).abs().max() <= 1e-6
    assert _max_diff(ref["params_1"], got["params_1"]) <= 1e-6
    for key in ("loss", "clip_bias/norm", "clip_bias/factor", "grad_norm", "clip_frac", "kl_ref", "entropy"):
        # grad_norm: with ETP != TP every expert counts once (not dropped as a TP duplicate)
        assert got["m1"][key] == pytest.approx(ref["m1"][key], rel=1e-6, abs=1e-7), key


def test_uneven_gather_cpu_patch_is_needed(ws2):
    for r in _ok(ws2, "compat_uneven_2")["results"]:
        assert "ProcessGroupGloo::allgather: invalid tensor size" in r["unpatched"]
        assert r["patched"] is True and r["even"] is True


def test_critic_layouts_equal_world_size_1(ws1, ws2, engine_work):
    _ok(ws1, "critic_ws1")
    ref = _load(engine_work, "critic_ws1")
    assert ref["m"]["steps"] == 2 and ref["m"]["value_clip_frac"] > 0
    assert (ref["v1"] - ref["v0"]).abs().max() > 1e-4  # the update moved the values
    assert (ref["v0"][:, 0] == 0).all()  # no value before the first token
    for tag in ("critic_tp2", "critic_pp2"):
        _ok(ws2, tag)
        got = _load(engine_work, tag)
        assert (ref["v0"] - got["v0"]).abs().max() < TOL
        assert (ref["v1"] - got["v1"]).abs().max() < TOL
        assert _max_diff(ref["params"], got["params"]) < TOL
        assert got["m"]["value_loss"] == pytest.approx(ref["m"]["value_loss"], rel=1e-5)


def test_sft_update_is_cross_entropy_and_matches_across_layouts(ws1, ws2, engine_work):
    _ok(ws1, "sft_ws1")
    ref = _load(engine_work, "sft_ws1")
    mask = ref["mask"].bool()
    nll0 = float(-ref["lp0"][mask].mean())
    assert ref["m"][0]["sft/nll"] == pytest.approx(nll0, rel=1e-5)  # the loss is -mean log p on loss-mask tokens
    assert float(-ref["lp1"][mask].mean()) < nll0 - 1e-3  # three steps of SFT lowered it
    _ok(ws2, "sft_tp2")
    got = _load(engine_work, "sft_tp2")
    assert _max_diff(ref["params"], got["params"]) < TOL
    assert (ref["lp1"] - got["lp1"]).abs().max() < TOL


# ---------------------------------------------------------------- BF16 mixed precision
#
# bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~ 3.9e-3. The bf16 engine rounds the
# HF weights and every activation to it (megatron's Float16Module), while the optimizer keeps
# float32 main parameters, gradients and Adam moments. So "within bf16 tolerance" here means:
#   * log-probs (|log p| <= ~5 on this model, a difference of O(1) logits each off by a few u):
#     |bf16 - fp32| <= 0.02 nats ~ u * max|log p|, before and after three steps (which move the
#     log-probs by ~0.8, 40x the tolerance);
#   * scalars of each step (loss, grad norm, KL, ||C||, entropy): relative 8u = 0.03;
#   * the parameter update of three Adam steps (fp32 main parameters): relative 0.1. Adam divides
#     each coordinate by its own RMS, so where a gradient coordinate is near zero bf16 noise can
#     flip its sign; 0.1 leaves room for that, a wrong master-weight or gradient path gives ~1.
# Both engines replay the fp32 engine's routes (R2): without replay a few routing decisions
# flip in bf16 and the experts behind them get other tokens' gradients (measured: the update
# differs by 18% instead of 3.6%), which is MoE routing sensitivity, not the precision path.
BF16_LOGPROB_TOL = 0.02
BF16_REL = 8 * 2**-8
BF16_UPDATE_REL = 0.1
BF16_METRICS = ("loss", "grad_norm", "kl_ref", "clip_bias/norm", "entropy")


def _bf16_close(fp32: dict, bf16: dict) -> dict:
    lp0 = float((fp32["lp0"] - bf16["lp0"]).abs().max())
    lp = float((fp32["lp"] - bf16["lp"]).abs().max())
    assert 1e-4 < lp0 < BF16_LOGPROB_TOL, lp0  # bf16 really ran (not fp32 under another name)
    assert lp < BF16_LOGPROB_TOL < float((fp32["lp"] - fp32["lp0"]).abs().max()) / 10, lp
    assert (fp32["ent0"] - bf16["ent0"]).abs().max() < BF16_LOGPROB_TOL
    assert len(fp32["m"]) == len(bf16["m"]) == 3
    for a, b in zip(fp32["m"], bf16["m"]):
        for key in BF16_METRICS:
            assert b[key] == pytest.approx(a[key], rel=BF16_REL, abs=1e-6), key
        assert b["clip_frac"] == pytest.approx(a["clip_frac"], abs=0.05)
    return {"logprobs_before": lp0, "logprobs_after": lp}


def test_bf16_mixed_precision_update_stays_within_bf16_tolerance_of_fp32(ws1, engine_work):
    r = _ok(ws1, "bf16_ws1")
    # megatron's mixed precision: bf16 model, Float16OptimizerWithFloat16Params with fp32 main
    # parameters and fp32 gradient buffers; the bf16 parameters are the rounded main parameters
    assert r["bf16"] == {"param_dtypes": ["torch.bfloat16"], "main_dtypes": ["torch.float32"],
                         "grad_dtypes": ["torch.float32"], "optimizers": ["Float16OptimizerWithFloat16Params"],
                         "model_is_rounded_main": True,
                         "resume_max_diff": 0.0}  # saved after 3 steps, loaded: step 4 equals (fp32 main weights too)
    assert r["fp32"]["optimizers"] == ["FP32Optimizer"]
    runs = _load(engine_work, "bf16_ws1")
    fp32, bf16 = runs["fp32"], runs["bf16"]
    got = _bf16_close(fp32, bf16)
    # the update of the fp32 main parameters (bf16's start from the rounded HF weights)
    d32 = {k: fp32["main"][k] - fp32["main0"][k] for k in fp32["main"]}
    d16 = {k: bf16["main"][k] - bf16["main0"][k] for k in fp32["main"]}
    norm = sum(float((d ** 2).sum()) for d in d32.values()) ** 0.5
    err = sum(float(((d32[k] - d16[k]) ** 2).sum()) for k in d32) ** 0.5
    print({**got, "update_rel": err / norm})
    assert norm > 0.1 and err / norm < BF16_UPDATE_REL
    start = max(float((fp32["main0"][k] - bf16["main0"][k]).abs().max()) for k in d32)
    assert 0 < start <= 2**-8 * max(float(v.abs().max()) for v in fp32["main0"].values())  # one rounding


def test_bf16_critic_stays_within_bf16_tolerance_of_fp32(ws1, engine_work):
    """The value engine in bf16 (its scalar head too; values come out fp32): values before and
    after one step (two mini-batches) from the same weights on the same batch."""
    _ok(ws1, "bf16_ws1")
    runs = _load(engine_work, "bf16_ws1")
    fp32, bf16 = runs["critic_fp32"], runs["critic_bf16"]
    assert bf16["optimizers"] == ["Float16OptimizerWithFloat16Params"] and bf16["v0"].dtype == torch.float32
    scale = float(fp32["v0"].abs().max())
    assert 1e-4 < float((fp32["v0"] - bf16["v0"]).abs().max()) < BF16_REL * scale  # measured 0.023 of 2.8
    d32, d16 = fp32["v1"] - fp32["v0"], bf16["v1"] - bf16["v0"]
    assert float((d32 - d16).norm() / d32.norm()) < BF16_UPDATE_REL  # measured 0.021
    for key in ("value_loss", "grad_norm"):
        assert bf16["m"][key] == pytest.approx(fp32["m"][key], rel=BF16_REL), key


@pytest.mark.parametrize("tag", ["bf16_tp2", "bf16_dp2_distopt"])
def test_bf16_layouts_stay_within_bf16_tolerance(ws1, ws2, engine_work, tag):
    """TP=2 with sequence parallelism (bf16 activations across the TP collectives), and DP=2 with
    megatron's DistributedOptimizer (fp32 main-parameter shards, bf16 parameter all-gather)."""
    _ok(ws1, "bf16_ws1")
    r = _ok(ws2, tag)
    assert r["bf16"]["param_dtypes"] == ["torch.bfloat16"]
    assert r["bf16"]["optimizers"] == (["DistributedOptimizer"] if "distopt" in tag
                                       else ["Float16OptimizerWithFloat16Params"])
    if "distopt" in tag:  # its fp32 main-parameter shards and Adam state resume exactly ...
        assert r["bf16"]["resume_max_diff"] == 0.0
        # ... with the CPU patches for torch Adam's per-parameter step (apex / TE's Adam keeps it per
        # group): a fresh optimizer has none for state_dict() to read, and the checkpoint holds none
        assert r["bf16"]["unpatched_fresh_load"] == "AssertionError: "
        assert r["bf16"]["unpatched_load"] == "KeyError: 'step'"
    ref, got = _load(engine_work, "bf16_ws1"), _load(engine_work, tag)
    _bf16_close(ref["fp32"], got["bf16"])
    assert (ref["fp32"]["lp"] - got["fp32"]["lp"]).abs().max() < TOL  # the layout's fp32 run equals world size 1


# ---------------------------------------------------------------- routing replay


@pytest.mark.parametrize("tag", ["replay_ws1", "replay_ep2", "replay_tp2"])
def test_routing_replay(ws1, ws2, engine_work, tag):
    r = _ok(ws1 if tag.endswith("ws1") else ws2, tag)
    # R2: the weights changed enough that live routing differs, yet replay used the record
    assert r["live_differs_frac"] > 0.05
    assert r["replay_used_equals_recorded"]
    assert r["m_first"]["routing/replay_mismatch_frac"] == 0.0  # same weights as the record
    assert r["m_last"]["routing/replay_mismatch_frac"] > 0.0
    assert r["used_replay_mismatch"] == pytest.approx(r["live_differs_frac"], abs=0.25)
    # R3: given indices exactly, missing (-1) -> live router
    assert r["r3_given_used_exactly"]
    assert r["r3_missing_fall_back_to_live"]
    assert r["r3_mismatch"] > 0.5  # random routes mostly differ from the live ones
    assert r["recorded_pad_is_minus_one"]
    if tag != "replay_ws1":
        ref, got = _load(engine_work, "replay_ws1"), _load(engine_work, tag)
        assert torch.equal(ref["recorded"], got["recorded"])
        assert torch.equal(ref["r3_used"], got["r3_used"])
        # after 3 Adam steps at lr=2e-2 (large on purpose: the routing must change), TP's
        # different reduction order (~1e-7 per step) has grown to a few 1e-5
        assert (ref["r3_logprobs"] - got["r3_logprobs"]).abs().max() < 1e-4


def test_routing_replay_under_activation_recompute(ws1):
    r = _ok(ws1, "recompute_ws1")
    assert r["replays_in_backward"][0] == 0 and r["replays_in_backward"][1] > 0  # recompute really ran
    assert r["param_diff"] == 0.0
    assert r["losses"][0] == r["losses"][1]


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("tag", ["resume_same", "resume_tp2_to_pp2"])
def test_resume_equals_uninterrupted(ws2, tag):
    r = _ok(ws2, tag)
    assert r["extra"] == {"trainer_step": 1}
    assert r["step"] == 4  # 2 optimizer steps per update, 2 updates
    assert r["lr"][0] == pytest.approx(r["lr"][1])
    assert r["actor_max_diff"] < TOL
    assert r["critic_max_diff"] < TOL
    assert r["loss_diff"] < 1e-6
    assert r["no_tmp_left"]
    saved, loaded = r["clip_bias_running"]
    assert saved is not None and loaded == saved  # the relative form's running mean resumes
    # a flipped bit in step_2 (hashed by one rank only): both ranks fall back to step_1 and a
    # direct load of step_2 fails on both with the same error naming the file
    assert [os.path.basename(p) for p in r["newest"]] == ["step_1", "step_1"]
    assert r["damaged_error"][0] == r["damaged_error"][1]
    assert r["damaged_error"][0].startswith(f"CheckpointDamagedError: {r['damaged_file']}: sha256 differs")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("tag", ["bad_ws1", "bad_ep2"])
def test_bad_input_errors_clearly(ws1, ws2, tag):
    r = _ok(ws1 if tag.endswith("ws1") else ws2, tag)
    assert "advantages shape (8, 11)" in r["advantages_shape"]
    assert "old_logprobs shape (7, 12)" in r["old_logprobs_shape"]
    assert "routed_experts shape (8, 12, 2, 3)" in r["routing_shape"]
    assert "routed_experts values" in r["routing_values"]
    assert "empty batch" in r["empty"]
    assert "right padding" in r["left_padded"]
    assert "mini_batch_size" in r["mini_batch"]
    for key in ("advantages_shape", "routing_shape", "empty", "mini_batch"):
        assert r[key + "_s"] < 5.0  # raised up front, no collective timeout
    assert r["after_ok"]


def test_optimizer_cpu_patch_is_needed(ws1):
    r = _ok(ws1, "compat_ws1")
    assert "Torch not compiled with CUDA" in r["fp32_optimizer_unpatched"]
    assert r["clip_unpatched"] is not None and r["clip_unpatched"].startswith("AssertionError")
    assert r["fp32_optimizer_patched"] is None
    assert r["clip_patched"] is None


# ---------------------------------------------------------------- issue 20's MoE families


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen2_moe", "glm4_moe"])
def test_family_update_at_ep2_equals_world_size_1(ws1, ws2, engine_work, model):
    """Three optimizer steps at EP=2 land where world size 1 does. DeepSeek-V3: MLA, a leading
    dense layer, one shared expert, sigmoid routing with a correction bias and group-limited top-k;
    Qwen2-MoE: softmax top-k without renormalization, the sigmoid-gated shared expert; GLM-4.5:
    partial rotary, q/k/v biases, a leading dense layer, sigmoid routing with the bias."""
    _ok(ws1, f"actor_{model}_ws1")
    _ok(ws2, f"actor_{model}_ep2")
    ref, got = _load(engine_work, f"actor_{model}_ws1"), _load(engine_work, f"actor_{model}_ep2")
    assert (ref["logprobs"] - got["logprobs"]).abs().max() <= 1e-6
    assert _max_diff(ref["params_1"], got["params_1"]) <= 1e-6
    assert _max_diff(ref["params_3"], got["params_3"]) <= 1e-6
    assert _max_diff(ref["params_1"], ref["params_3"]) > 1e-4  # the later steps moved them
    for m in ("m1", "m2", "m3"):
        assert got[m]["loss"] == pytest.approx(ref[m]["loss"], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("model", ["deepseek_v3", "glm4_moe", "qwen2_moe"])
def test_family_routing_replay(ws1, model):
    """R2 records and replays each family's router choice (DeepSeek-V3: grouped sigmoid + bias,
    GLM-4.5: sigmoid + bias, Qwen2-MoE: softmax beside a gated shared expert); R3 uses given
    random routes exactly (a leading dense layer has no router: its entries stay -1)."""
    r = _ok(ws1, f"replay_{model}_ws1")
    assert r["live_differs_frac"] > 0.05 and r["replay_used_equals_recorded"]
    assert r["m_first"]["routing/replay_mismatch_frac"] == 0.0
    assert r["r3_given_used_exactly"] and r["r3_missing_fall_back_to_live"] and r["r3_mismatch"] > 0.5
    assert r["recorded_pad_is_minus_one"]


@pytest.mark.parametrize("tag", [
    "rollout_r3_deepseek_v3_ws1", "rollout_r3_glm4_moe_ws1", "rollout_r3_qwen2_moe_ws1", "rollout_r3_deepseek_v3_ep2",
])
def test_rollout_routes_replay_exactly(ws1, ws2, tag):
    """The embedded server's routed experts (one row per layer, -1 on the leading dense layers as
    SGLang leaves them unrouted) are what Megatron's router picks at the same weights, and R3
    replays them exactly; the server's log-probs are the engine's."""
    r = _ok(ws2 if tag.endswith("ep2") else ws1, tag)
    dense_first = not tag.startswith("rollout_r3_qwen2_moe")
    assert r["routed_layers"] == ([False, True] if dense_first else [True, True])
    assert r["num_moe_layers"] == (1 if dense_first else 2) and r["dense_rows_unrouted"]
    assert r["given_pairs"] > 20
    assert r["r3_used_exactly"] and r["live_equals_rollout"] and r["replay_mismatch"] == 0.0
    assert r["logprob_max_diff"] <= 1e-5


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen2_moe", "glm4_moe"])
def test_family_logits_match_transformers_at_tp2_ep2_4_ranks(ws4, model):
    """Megatron logits vs transformers at TP2 x EP2 (expert TP 2: each rank holds half of the
    routed experts, each split in half along its FFN). The bridge's logits check
    (tests/bridge/worker.py), run here because this is the suite's four-process launch."""
    r = _ok(ws4, f"logits_{model}_tp2_ep2_4r")
    print(model, r["max_abs_diff"])
    assert r["max_abs_diff"] <= LOGIT_TOL, r
    assert r["shape"] == [2, 12, 128]


# ---------------------------------------------------------------- batch transfer


@pytest.mark.parametrize("tag", ["transfer_dp2", "transfer_dp2_packed", "transfer_dp4", "transfer_tp2_dp2_4r"])
def test_batch_transfer_equals_the_whole_batch_broadcast(request, tag):
    """Rank 0's batch as tensors with the R3 routes only for each DP rank's rows (int8, real
    tokens) gives the R3 old-logprob pass and a shuffled two-epoch update bit for bit what the
    whole batch pickled to every rank gives, on every rank; TP peers hold the same rows."""
    r = _ok(request.getfixturevalue("ws4" if tag.startswith(("transfer_dp4", "transfer_tp2")) else "ws2"), tag)
    assert r["update_ran"] == 4.0 and r["clip_frac"] > 0  # four optimizer steps that clipped something
    held: dict[int, list[int]] = {}
    for rank in r["ranks"]:
        assert all(rank["same"].values()), rank
        assert rank["routes_type"] == "RoutedRows" and rank["routes_wire"] == "torch.int8" and rank["routes_exact"]
        assert held.setdefault(rank["dp_rank"], rank["held_rows"]) == rank["held_rows"]  # TP peers: same rows
    assert len(held) == (4 if tag == "transfer_dp4" else 2)
    assert any(len(rows) < r["rows"] for rows in held.values())  # some rank was sent fewer than all rows
