"""What DeepSeek-V3 and GLM-4.5 share (not a family): sigmoid router scores with the
``e_score_correction_bias`` expert bias, optional group-limited top-k, ``routed_scaling_factor``,
``n_shared_experts`` shared experts of ``moe_intermediate_size``, leading dense layers
(``first_k_dense_replace``) and an MTP module that is never built.

mbridge 0.15.1's bridges of both never set group-limited top-k; they update the expert bias
during training (RL keeps the checkpoint's: the rollout engine routes with it), and GLM's sizes
its shared experts ``moe_intermediate_size`` whatever ``n_shared_experts`` says.
"""

from __future__ import annotations

from typing import Any

from .spec import FamilyConfigError, get

DENSE_PREFIX_KEY = "first_k_dense_replace"


def shared_expert_size(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size) * int(get(hf_config, "n_shared_experts", 0))


def check(hf_config: Any) -> None:
    """Routing configurations megatron's sigmoid router computes differently."""
    mt = hf_config.model_type
    if not bool(get(hf_config, "norm_topk_prob", True)) and int(hf_config.num_experts_per_tok) > 1:
        raise FamilyConfigError(
            f"{mt} with norm_topk_prob=False: megatron's sigmoid router always renormalizes the top-k "
            "scores (moe_utils.topk_routing_with_score_function)"
        )
    groups, group_topk = int(get(hf_config, "n_group", 1)), int(get(hf_config, "topk_group", 1))
    topk, experts = int(hf_config.num_experts_per_tok), int(hf_config.n_routed_experts)
    if groups > 1:
        if experts % groups:
            raise FamilyConfigError(f"{mt}: n_group={groups} does not divide n_routed_experts={experts}")
        # HF scores a group by its top-2 experts; megatron by its top-(topk // group_topk).
        if group_topk < 1 or topk % group_topk or topk // group_topk != 2:
            raise FamilyConfigError(
                f"{mt}: group-limited routing with num_experts_per_tok={topk}, topk_group={group_topk}: "
                "HF sums each group's top-2 scores, megatron its top-(num_experts_per_tok // topk_group) "
                "(moe_utils.group_limited_topk); they agree only when that is 2"
            )


def config_overrides(hf_config: Any) -> dict[str, Any]:
    over: dict[str, Any] = {}
    groups = int(get(hf_config, "n_group", 1))
    if groups > 1:
        over["moe_router_num_groups"] = groups
        over["moe_router_group_topk"] = int(get(hf_config, "topk_group", 1))
    over["moe_router_topk_scaling_factor"] = float(get(hf_config, "routed_scaling_factor", 1.0))
    # RL keeps the load-balancing bias the checkpoint has (the rollout engine routes with it).
    over["moe_router_bias_update_rate"] = 0.0
    over["moe_router_load_balancing_type"] = "none"
    over["moe_shared_expert_intermediate_size"] = shared_expert_size(hf_config)
    over["mtp_num_layers"] = None  # MTP weights are skipped on load (see docs/how-to/convert.md)
    return over
