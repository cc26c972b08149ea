"""Uneven pipeline stages (ParallelLayout.first_stage_layers / last_stage_layers): the split
each rank gets and the checks that refuse impossible splits naming the keys, pure Python.
(Agreement with megatron's own placement: test_models_cpu.py::test_uneven_split_rules_agree_with_megatron.)"""

from __future__ import annotations

import pytest
from transformers import DeepseekV3Config

from sorl_megatron.bridge.layout import LayoutError, ParallelLayout, megatron_pipeline_split, validate_layout

from .tiny_models import qwen2_config

# DeepSeek-V3's shape (config.json of deepseek-ai/DeepSeek-V3): 61 layers, a prime count
DEEPSEEK_V3 = DeepseekV3Config(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
)


def test_stage_layers_of_each_split():
    assert ParallelLayout(pp=4).stage_layers(8) == [2, 2, 2, 2]
    assert ParallelLayout(pp=2, first_stage_layers=1).stage_layers(3) == [1, 2]
    assert ParallelLayout(pp=2, last_stage_layers=1).stage_layers(4) == [3, 1]
    assert ParallelLayout(pp=4, first_stage_layers=16).stage_layers(61) == [16, 15, 15, 15]
    assert ParallelLayout(pp=8, first_stage_layers=5, last_stage_layers=8).stage_layers(61) == [5] + [8] * 7
    assert ParallelLayout(pp=16, first_stage_layers=3, last_stage_layers=2).stage_layers(61) == [3] + [4] * 14 + [2]


@pytest.mark.parametrize("layout", [
    ParallelLayout(pp=4, first_stage_layers=16),
    ParallelLayout(pp=8, first_stage_layers=5),
    ParallelLayout(pp=16, first_stage_layers=3, last_stage_layers=2),
    ParallelLayout(pp=2, first_stage_layers=30, last_stage_layers=31),
])
def test_deepseek_v3_splits_only_unevenly(layout):
    validate_layout(layout, DEEPSEEK_V3)
    assert sum(layout.stage_layers(61)) == 61
    even = ParallelLayout(pp=layout.pp)
    with pytest.raises(LayoutError, match=r"stages do not divide num_hidden_layers=61") as info:
        validate_layout(even, DEEPSEEK_V3)
    assert info.value.keys == ("pp",)
    assert "first_stage_layers / last_stage_layers" in str(info.value)  # the message says what to set


@pytest.mark.parametrize("layout,needle,keys", [
    # 61 - 5 = 56 layers do not split over 6 middle ranks
    (ParallelLayout(pp=8, first_stage_layers=5, last_stage_layers=6), "do not split evenly over the 6 middle",
     ("first_stage_layers", "last_stage_layers", "pp")),
    # more layers than the model has
    (ParallelLayout(pp=4, first_stage_layers=40, last_stage_layers=30), "leave -9 layers for 2 middle",
     ("first_stage_layers", "last_stage_layers", "pp")),
    # PP 2 with both ends given: they must add up to the layers (no middle rank takes the rest)
    (ParallelLayout(pp=2, first_stage_layers=30, last_stage_layers=30), "= 60 must equal num_hidden_layers=61",
     ("first_stage_layers", "last_stage_layers", "pp")),
    # the ends take every layer: the middle ranks would be empty
    (ParallelLayout(pp=3, first_stage_layers=30, last_stage_layers=31), "leave 0 layers for 1 middle",
     ("first_stage_layers", "last_stage_layers", "pp")),
    (ParallelLayout(first_stage_layers=3), "need PP > 1", ("first_stage_layers", "pp")),
    (ParallelLayout(pp=2, last_stage_layers=0), "last_stage_layers=0 must be >= 1", ("last_stage_layers",)),
    # VPP splits each rank's layers evenly over its chunks (megatron's ValueError / assert)
    (ParallelLayout(pp=4, vpp=2, first_stage_layers=13), "VPP=2 does not divide first_stage_layers=13",
     ("first_stage_layers", "vpp")),
    (ParallelLayout(pp=4, vpp=2, first_stage_layers=16), "VPP=2 does not divide the 15 layers of each middle",
     ("vpp", "first_stage_layers")),
    (ParallelLayout(pp=4, vpp=3, first_stage_layers=16), "VPP=3 does not divide first_stage_layers=16",
     ("first_stage_layers", "vpp")),
])
def test_impossible_uneven_splits_name_the_keys(layout, needle, keys):
    with pytest.raises(LayoutError) as info:
        validate_layout(layout, DEEPSEEK_V3)
    assert needle in str(info.value), str(info.value)
    assert info.value.keys == keys


def test_interleaved_uneven_splits():
    """With VPP every rank's layer count must split over its chunks, so a prime layer count
    (DeepSeek-V3's 61) never interleaves; an even one can, unevenly."""
    for vpp in (2, 3):
        for first in range(vpp, 30, vpp):
            with pytest.raises(LayoutError):
                validate_layout(ParallelLayout(pp=4, vpp=vpp, first_stage_layers=first), DEEPSEEK_V3)
    six = qwen2_config(layers=6)
    validate_layout(ParallelLayout(pp=2, vpp=2, first_stage_layers=2), six)  # 1 | 2, then 1 | 2 per chunk
    validate_layout(ParallelLayout(pp=2, vpp=2, first_stage_layers=2, last_stage_layers=4), six)
    ten = ParallelLayout(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2)  # 2 | 3 3 | 2
    with pytest.raises(LayoutError, match="VPP=2 does not divide the 3 layers of each middle") as info:
        validate_layout(ten, qwen2_config(layers=10))
    assert info.value.keys == ("vpp", "first_stage_layers", "last_stage_layers")


def test_megatron_gets_first_alone_at_pp2_with_both_ends():
    """megatron 0.16.1 divides by the number of middle ranks when it offsets interleaved
    chunks (0 // 0 at PP 2 with both ends set): the last rank as the lone "middle" rank holds
    the same layers, so only the first is passed."""
    assert megatron_pipeline_split(ParallelLayout(pp=2, first_stage_layers=2, last_stage_layers=4)) == {
        "num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": None}
    assert megatron_pipeline_split(ParallelLayout(pp=4, first_stage_layers=2, last_stage_layers=4)) == {
        "num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 4}
    assert megatron_pipeline_split(ParallelLayout(pp=4)) == {}


def test_layout_strings_and_description():
    layout = ParallelLayout.from_string("pp=2,first_stage_layers=1")
    assert (layout.pp, layout.first_stage_layers, layout.last_stage_layers) == (2, 1, None)
    assert layout.describe() == "TP=1 PP=2 (first 1 layers)"
    both = ParallelLayout.from_string("pp=8,first_stage_layers=5,last_stage_layers=8")
    assert both.describe() == "TP=1 PP=8 (first 5, last 8 layers)"
    with pytest.raises(LayoutError, match="first_stage_layers,last_stage_layers"):
        ParallelLayout.from_string("pp=2,first=1")
