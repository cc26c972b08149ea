"""Uneven pipeline splits: bridge/layout.py's rules against megatron-core's own arithmetic.

Run inside the single-process bridge worker (megatron is imported there anyway). For every
(layers, PP, VPP, first, last) in a grid, megatron's TransformerConfig plus
`get_num_layers_to_build` / `get_transformer_layer_offset` (the functions that number the
layers mbridge maps to HF names) must place exactly the layers `ParallelLayout.stage_layers`
predicts whenever `check_pipeline_split` accepts, and every split megatron refuses (or builds
with an empty or overlapping stage) must be refused by `check_pipeline_split`.
"""

from __future__ import annotations

import itertools

import torch

from sorl_megatron.bridge.layout import LayoutError, ParallelLayout, check_pipeline_split, megatron_pipeline_split


def predicted(layout: ParallelLayout, layers: int) -> dict:
    """(pp rank, virtual stage) -> global layer ids: chunk-major, as the interleaved schedule runs them."""
    per_rank, out, nxt = layout.stage_layers(layers), {}, 0
    for v in range(layout.vpp):
        for r in range(layout.pp):
            n = per_rank[r] // layout.vpp
            out[(r, v)] = list(range(nxt, nxt + n))
            nxt += n
    return out


def megatron_placement(layout: ParallelLayout, layers: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        cfg = TransformerConfig(
            num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            **megatron_pipeline_split(layout),
        )
        out = {}
        for r, v in itertools.product(range(layout.pp), range(layout.vpp)):
            stage = v if layout.vpp > 1 else None
            offset = get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=r)
            out[(r, v)] = list(range(offset, offset + get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=r)))
    except (ValueError, AssertionError, ZeroDivisionError) as err:
        return f"{type(err).__name__}"
    if sorted(sum(out.values(), [])) != list(range(layers)) or not all(out.values()):
        return "bad placement"  # accepted by megatron, but a stage is empty or layers overlap
    return out


def run_grid() -> dict:
    counts = {"both_accept": 0, "both_refuse": 0, "we_refuse_megatron_accepts": 0}
    mismatches, accepted_refused, extra_refusals = [], [], []
    none_or = (None, 1, 2, 3, 4)
    for layers, pp, vpp, first, last in itertools.product((3, 5, 6, 7, 8, 12), (2, 3, 4), (1, 2, 3), none_or, none_or):
        layout = ParallelLayout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
        try:
            check_pipeline_split(layout, layers)
            ours = predicted(layout, layers)
        except LayoutError:
            ours = None
        theirs = megatron_placement(layout, layers)
        what = f"{layers} layers, {layout.describe()}"
        if ours is not None and not isinstance(theirs, dict):
            accepted_refused.append(f"{what}: megatron {theirs}")
        elif ours is not None and ours != theirs:
            mismatches.append(f"{what}: ours {ours}, megatron {theirs}")
        elif ours is not None:
            counts["both_accept"] += 1
        elif isinstance(theirs, dict):
            counts["we_refuse_megatron_accepts"] += 1
            extra_refusals.append(what)
        else:
            counts["both_refuse"] += 1
    return {"counts": counts, "mismatches": mismatches, "accepted_refused": accepted_refused,
            "extra_refusals": extra_refusals}
