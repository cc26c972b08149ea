"""Every GPU recipe's weight sync against SGLang's own loader rules (SGLang 0.5.21's wheel).

For each model of recipes/gpu/*.yaml at its layout, the sync plan (``weight_sync.plan``: the
real export at full size on the meta device, every sending rank's stream and buckets) goes
through SGLang's ``load_weights`` (tests/weight_sync/sglang_loaders.py: the functions from the
wheel, executed on CPU), one call per request as a server makes it:

- the trainer sends the HF checkpoint transformers defines for the config, each tensor once;
- every name it sends, SGLang loads (none skipped, none left in a fusion cache);
- every parameter SGLang holds gets its tensor in every sync (none stale): the units SGLang
  fills when it loads that checkpoint whole (its startup load), and on an FP8 server the
  ``weight_scale_inv`` of each block-quantized one;
- every group SGLang fuses within one call (DeepSeek's ``q_a_proj`` with ``kv_a_proj_with_mqa``
  into ``fused_qkv_a_proj_with_mqa``), and each FP8 weight with its scale, arrives in one
  request: a distributed bucket, or a tensor-transport body (``weight_sync.tensor``'s bucket
  size over the same order; the disk transport is one load of the whole checkpoint).

The plans take minutes (one planner process for all recipes, DeepSeek-V3's 256 ranks included);
``SORL_SYNC_PLANS=<file>`` reads them from what ``python -m sorl_megatron.trainer.recipe.sync_plan
recipes/gpu/*.yaml --json <file>`` wrote instead (the same plans, when the code is the same).
"""

from __future__ import annotations

import ast
import glob
import json
import os
from collections import defaultdict

import pytest

from sorl_megatron.common.buckets import buckets
from sorl_megatron.weight_sync.plan import SyncPlan, config_from_json
from sorl_megatron.weight_sync.tensor import TENSOR_BUCKET_BYTES
from tests.weight_sync import sglang_loaders as sgl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "gpu", "*.yaml")))


@pytest.fixture(scope="module")
def plans():
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.recipe.sync_plan import plan_job, plan_recipes

    sgl.helpers()  # the wheel first: a test without a package index skips before the planner runs
    saved = os.environ.get("SORL_SYNC_PLANS")
    if saved:
        with open(saved) as f:
            by_recipe = {os.path.join(ROOT, r) if not os.path.isabs(r) else r: SyncPlan.from_json(p)
                         for r, p in json.load(f).items()}
    else:
        by_recipe = plan_recipes(RECIPES)
    out = {}
    for recipe, plan in by_recipe.items():
        job = plan_job(load_recipe(recipe))
        key = (os.path.basename(job["config"]), plan.layout, plan.weight_format)
        out.setdefault(key, (job, plan, []))[2].append(os.path.basename(recipe))
    return out


def test_a_request_is_one_load_weights_call_and_the_fusion_cache_lives_in_it():
    """What the test below rests on, in the wheel: the server loads each distributed request with
    one ``load_weights`` call, and DeepSeek's cache of a-projections is a local of that call."""
    from tests import sglang_wheel

    src = sglang_wheel.function_source(sglang_wheel.source(sgl.UPDATER), "load_weights_from_distributed",
                                       cls="WeightUpdater")
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "load_weights"]
    assert len(calls) == 1
    module, cls, name = sgl.FAMILIES["deepseek_v3"]
    body = ast.parse(sglang_wheel.function_source(sglang_wheel.source(module), name, cls=cls))
    assigned = {t.id for n in ast.walk(body) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert "cached_a_proj" in assigned


def _models() -> list[str]:
    return ["deepseek_v3.json", "moonlight_16b_a3b.json", "qwen3_235b_a22b.json", "qwen3_30b_a3b.json",
            "qwen2.5_7b.json", "qwen2.5_3b.json"]


def _cases(plans, model: str):
    found = [v for k, v in plans.items() if k[0] == model]
    assert found, f"no GPU recipe uses {model} (recipes: {sorted(plans)})"
    return found


def _short(items, n: int = 3) -> str:
    items = list(items)
    return f"{len(items)}: " + "; ".join(map(str, items[:n])) + (" ..." if len(items) > n else "")


@pytest.mark.parametrize("model", _models())
def test_the_trainer_sends_the_hf_checkpoint_once(plans, model):
    for job, plan, recipes in _cases(plans, model):
        cfg = config_from_json(job["config"])
        want = dict(sgl.checkpoint_names(cfg))
        sent: dict[str, list] = defaultdict(list)
        for s in plan.senders:
            for e in s.entries:
                if not e.name.endswith("_scale_inv"):
                    sent[e.name].append((s.rank, e.shape))
        twice = {n: v for n, v in sent.items() if len(v) > 1}
        assert not twice, f"{recipes}: sent by more than one rank {_short(twice.items())}"
        assert sorted(set(sent) - set(want)) == [], f"{recipes}: not in the checkpoint"
        assert sorted(set(want) - set(sent)) == [], f"{recipes}: never sent"
        shapes = [(n, v[0][1], want[n]) for n, v in sent.items() if tuple(v[0][1]) != tuple(want[n])]
        assert shapes == [], f"{recipes}: shapes differ {_short(shapes)}"


def _variants(cfg) -> list[int]:
    """SGLang's shared-expert fusion for DeepSeek (one shared expert, fused as expert n_routed
    where the hardware allows it): both ways."""
    shared = getattr(cfg, "n_shared_experts", None)
    return [0, 1] if cfg.model_type == "deepseek_v3" and shared == 1 else [0]


@pytest.mark.parametrize("model", _models())
def test_sglang_loads_every_sent_name_refreshes_every_parameter_and_gets_fused_groups_whole(plans, model):
    for job, plan, recipes in _cases(plans, model):
        cfg = config_from_json(job["config"])
        fp8 = plan.weight_format == "block_fp8"
        reference = sgl.checkpoint_names(cfg)
        for fused_shared in _variants(cfg):
            params = sgl.receiver_params(cfg, [n for n, _ in reference], fused_shared)
            if fp8:
                params |= sgl.fp8_params(params, sgl.quantized_modules(cfg.model_type))
            server = sgl.Receiver(cfg, params, quantized=fp8, fused_shared_experts=fused_shared)
            # SGLang's startup load of the checkpoint, whole: it reaches every name (the derived
            # parameter names are the ones its code looks up) and says what each sync must fill
            startup = server.load((n, sgl.meta(s, "bfloat16")) for n, s in reference)
            reached, names = {n for ld in startup for n in ld.sources}, {n for n, _ in reference}
            assert reached == names, f"{model}: SGLang skips {_short(names - reached)}"
            units = {ld.unit for ld in startup}
            if fp8:
                units |= {(p + "_scale_inv", shard, e) for p, shard, e in units if p + "_scale_inv" in params}
            fused = [ld.sources for ld in startup if len(ld.sources) > 1]
            assert (cfg.model_type == "deepseek_v3" and cfg.q_lora_rank is not None) == bool(fused)

            requests = [(f"rank {s.rank} request {i}", [(e.name, sgl.meta(e.shape, e.dtype)) for e in b])
                        for s in plan.senders for i, b in enumerate(s.buckets())]
            _check(server, requests, units, fused, fp8, f"{recipes} (distributed, fused shared experts {fused_shared})")
            # the tensor transport's bodies: the whole model from rank 0 (here: sender after sender,
            # each sender's tensors in their order)
            whole = [(n, t) for _, bucket in requests for n, t in bucket]
            bodies = [(f"body {i}", b) for i, (b, _) in enumerate(buckets(whole, TENSOR_BUCKET_BYTES))]
            _check(server, bodies, units, fused, fp8, f"{recipes} (tensor bodies, fused shared experts {fused_shared})")


def _check(server: sgl.Receiver, requests, units, fused, fp8: bool, what: str) -> None:
    where: dict[str, str] = {}
    skipped, got = [], set()
    for label, bucket in requests:
        for name, _ in bucket:
            where[name] = label
        loads = server.load(bucket)
        reached = {n for ld in loads for n in ld.sources}
        skipped += [(name, label) for name, _ in bucket if name not in reached]
        got |= {ld.unit for ld in loads}
    split = [(g, sorted({where.get(n) for n in g})) for g in fused if len({where.get(n) for n in g}) > 1]
    if fp8:
        split += [((n, n + "_scale_inv"), [where[n], where[n + "_scale_inv"]]) for n in where
                  if n + "_scale_inv" in where and where[n] != where[n + "_scale_inv"]]
    stale = sorted(units - got, key=str)
    assert not split, f"{what}: groups SGLang fuses arrive in more than one request {_short(split)}"
    assert not skipped, f"{what}: names SGLang does not load {_short(skipped)}"
    assert not stale, f"{what}: parameters SGLang holds that the sync never fills {_short(stale)}"
