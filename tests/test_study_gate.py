"""The stability study's gate (issue 30, item 6; docs/study.md, "The gate").

The finding it asserts, the most robust of round two: **under injected routing mismatch, R3
(rollout routing replay) removes the train/inference mismatch, and no replay keeps it.** In
every round-two cell with ``rollout.inject.route_flip_fraction=0.03``, the train/inference KL
``mismatch/kl_k3`` stayed at the fp32 rounding floor (< 1e-12) at every step with R3 and above
1e-7 at every step without replay (median ~0.02), about 10 decades and 10 standard deviations
(over steps) apart; no validation-EM difference between the cells is robust yet.

The gate is the smallest pair of cells that shows it: GRPO with and without R3, the study's
injection, a few RL steps of the tiny model the fixture builds. Each step is a new batch of
rollouts, so the steps are the spread (the study's seeds differ by their rollouts too). It fails
if the injector stops perturbing the rollout's routes (the pair then agrees at the floor), if R3
stops replaying them (the pair then agrees above it), or if the KL stops telling them apart.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .trainer.e2e_helpers import BASE_RECIPE, ROOT, make_tiny_data, read_metrics, run_overrides, subprocess_env

# the study's cells (recipes/study/round2_replay.yaml): GRPO, with and without R3, at `route`
GRPO = ("algorithm.loss.name=grpo", "algorithm.advantage.estimator=grpo")
ROUTE = ("rollout.inject.route_flip_fraction=0.03",)
STEPS = 3
# fp32 log-probs recomputed on the same routes agree to ~1e-7 nats, a k3 KL of ~1e-13 (the study's
# R3 cells: at most 6e-13; this pair: ~5e-14); the study's no-replay cells stayed above 1e-7
FLOOR = 1e-10
# one cell takes ~45 s of CPU (its trainer and servers); the bound leaves room for a loaded machine
CELL_TIMEOUT_S = 480.0


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("gate_data"))


def _run_cells(tiny_data: Path, tmp_path: Path, cells: dict[str, tuple[str, ...]]) -> dict[str, list[dict]]:
    """Each cell a ``python -m sorl_megatron.train`` of its own, all at once (each is mostly one
    thread: on two cores the pair takes about as long as one); ``{cell: its step rows}``."""
    procs = {}
    try:
        for name, overrides in cells.items():
            args = run_overrides(tiny_data, tmp_path, name, *GRPO, *ROUTE, f"schedule.total_steps={STEPS}", *overrides)
            with (tmp_path / f"{name}.log").open("w") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "sorl_megatron.train", "--config", BASE_RECIPE, *args], cwd=ROOT,
                    env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + CELL_TIMEOUT_S
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the gate's cell {name} did not finish in {CELL_TIMEOUT_S:.0f} s")
            assert code == 0, f"the gate's cell {name} failed:\n{(tmp_path / f'{name}.log').read_text()[-4000:]}"
    finally:
        for proc in procs.values():  # the launch and its servers (one process group each)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    rows = {name: read_metrics(tmp_path / name) for name in cells}
    return {name: [r[step] for step in range(1, STEPS + 1)] for name, r in rows.items()}


@pytest.mark.slow
def test_gate_r3_removes_the_injected_train_inference_mismatch_and_no_replay_keeps_it(tiny_data, tmp_path):
    cells = _run_cells(tiny_data, tmp_path, {"grpo": (), "grpo_r3": ("algorithm.routing_replay=r3",)})
    off, r3 = cells["grpo"], cells["grpo_r3"]
    # the injector works: in both cells the rollout's routes differ from the trainer's own router
    for cell, rows in cells.items():
        rates = [m["mismatch/route_flip_rate"] for m in rows]
        assert all(0.01 < r < 0.3 for r in rates), (cell, rates)
    kl_off = [m["mismatch/kl_k3"] for m in off]
    kl_r3 = [m["mismatch/kl_k3"] for m in r3]
    # R3 computes with the rollout's routes: the same policy, to fp32 rounding, at every step
    assert max(kl_r3) < FLOOR, kl_r3
    assert min(m["mismatch/ess_frac"] for m in r3) > 1 - 1e-6
    # without replay, the trainer's router gives another policy at every step
    assert min(kl_off) > 100 * FLOOR, kl_off  # this pair: 5e-7 to 3e-5
    # the effect, in decades of KL (the scale it spans), against the spread over steps
    log_off, log_r3 = [math.log10(v) for v in kl_off], [math.log10(max(v, 1e-30)) for v in kl_r3]
    effect = statistics.mean(log_off) - statistics.mean(log_r3)
    pooled_sd = math.sqrt((statistics.variance(log_off) + statistics.variance(log_r3)) / 2)
    assert effect > 2 * pooled_sd, (effect, pooled_sd, kl_off, kl_r3)
