"""Study injectors and leading indicators (issue 30), on tiny real runs.

- ``rollout.mode=lagged``: step k trains on the batch generated on weights k - lag (the
  pipeline filling at the start), read from ``episodes.jsonl``'s turn versions;
- the leading indicators are in every step's ``metrics.jsonl`` row;
- the route-flip injector (``rollout.inject``) with R3 replay gives ~zero train/inference KL
  (the trainer computes with the rollout's perturbed routes), without replay a positive one,
  and both report the injected route flip rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .e2e_helpers import (
    BASE_RECIPE,
    assert_finite,
    make_tiny_data,
    read_metrics,
    run_overrides,
    shared_embedded_servers,
)

INDICATORS = (
    "mismatch/ess_frac", "mismatch/ess_frac_seq", "mismatch/kl_k3", "actor/clip_frac/token", "actor/clip_frac/turn",
    "actor/clip_frac", "actor/grad_norm", "actor/clip_bias/logprob_norm", "actor/clip_bias/factor",
    "rollout/valid_action_ratio", "rollout/valid_action_turn_frac", "actor/advantage/mean", "actor/advantage/var",
    "actor/entropy/mean",
)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("inject_data"))


def _run(tiny_data, tmp_path, name, *overrides):
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.rl_loop import RLTrainer

    RLTrainer(load_recipe(BASE_RECIPE, run_overrides(tiny_data, tmp_path, name, *overrides))).run()
    return read_metrics(tmp_path / name)


def test_lag_k_trains_on_batches_k_versions_old_and_logs_the_indicators(tiny_data, tmp_path):
    with shared_embedded_servers(tiny_data, tmp_path / "servers") as servers:
        metrics = _run(tiny_data, tmp_path, "lag2", "schedule.total_steps=3", "rollout.mode=lagged",
                       "rollout.lagged.lag=2", "rollout.staleness.max=2", "algorithm.loss.is_correction.mode=tis",
                       *servers["overrides"])
    rows = [json.loads(x) for x in (tmp_path / "lag2" / "episodes.jsonl").read_text().splitlines() if x.strip()]
    for step, lag in ((1, 0), (2, 1), (3, 2)):  # the pipeline fills: min(k, lag) with k counted from 0
        trained = [r for r in rows if r["step"] == step and r["status"] == "trained"]
        assert len(trained) == 2
        lags = {r["trainer_version"] - v for r in trained for turns in r["turn_versions"] for v in turns}
        assert lags == {lag}, (step, lags)
        assert metrics[step]["rollout/version_lag_max"] == lag
    groups = sorted(r["group"] for r in rows)
    assert groups == list(range(len(groups)))  # drawn in order, none twice
    for step in (1, 2, 3):
        m = metrics[step]
        assert_finite(m, f"step {step}")
        missing = [k for k in INDICATORS if k not in m]
        assert not missing, (step, missing)
        assert 0 < m["mismatch/ess_frac"] <= 1 and 0 < m["mismatch/ess_frac_seq"] <= 1
        assert m["mismatch/kl_k3"] >= 0 and 0 <= m["actor/clip_frac/turn"] <= 1


def test_route_flip_injector_r3_reproduces_the_rollout_and_no_replay_does_not(tiny_data, tmp_path):
    inject = ("schedule.total_steps=1", "rollout.inject.route_flip_fraction=0.3", "rollout.inject.seed=5")
    r3 = _run(tiny_data, tmp_path, "r3", *inject, "algorithm.routing_replay=r3")[1]
    off = _run(tiny_data, tmp_path, "live", *inject)[1]  # routing_replay: off (the default)
    for m in (r3, off):
        assert 0.15 <= m["mismatch/route_flip_rate"] <= 0.5, m["mismatch/route_flip_rate"]
        assert m["mismatch/route_pairs"] > 100
    assert r3["mismatch/kl_k3"] < 1e-6, r3["mismatch/kl_k3"]  # R3 replays the perturbed routes the rollout used
    # the trainer's own routing: another policy (on the tiny model ~5e-5; fp32 noise is ~1e-13)
    assert off["mismatch/kl_k3"] > 1e-6, off["mismatch/kl_k3"]
    assert off["mismatch/ess_frac"] < r3["mismatch/ess_frac"]


def test_bf16_rollout_against_the_fp32_trainer_is_a_small_natural_mismatch(tiny_data, tmp_path):
    """``rollout.precision=bf16`` (the "natural" mismatch axis): the fp32 trainer's old log-probs
    differ from the bf16 server's by a small, nonzero train/inference KL."""
    m = _run(tiny_data, tmp_path, "bf16", "schedule.total_steps=1", "rollout.precision=bf16")[1]
    assert 1e-9 < m["mismatch/kl_k3"] < 1e-2, m["mismatch/kl_k3"]
    assert 0.9 < m["mismatch/ess_frac"] < 1.0
