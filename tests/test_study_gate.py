"""The stability study's gate (issue 30, item 6; issue 47, item 3; docs/study.md, "The gate").

The finding it asserts, the most robust of round two: **under injected routing mismatch, R3
(rollout routing replay) removes the train/inference mismatch, and no replay and R2 keep it.** In
every round-two cell with ``rollout.inject.route_flip_fraction=0.03``, the train/inference KL
``mismatch/kl_k3`` stayed at the fp32 rounding floor (< 1e-12) at every step with R3 and above
1e-7 at every step without replay and with R2 (median ~0.01-0.02), about 10 decades and 10
standard deviations (over steps) apart. This is an implementation invariant of routing replay, not
a stability finding: nothing about EM, collapse or a stabilizer is asserted (no validation-EM
difference between these cells is robust).

The gate is the smallest set of cells that shows it: GRPO with no replay, R2 and R3, the study's
injection, a few RL steps of the tiny model the fixture builds. Each step is a new batch of
rollouts, so the steps are the spread (the study's seeds differ by their rollouts too). It fails
if the injector stops perturbing the rollout's routes (every cell then agrees at the floor), if R3
stops replaying them (R3 then agrees with no replay above it), if R2 replays the rollout's routes
as R3 does (R2 then falls to the floor: R2 replays the trainer's own routes, recorded by the old
pass, and must keep the injected mismatch), or if the KL stops telling them apart.
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
# one cell takes ~45 s of CPU (its trainer and servers); three run at once; the bound leaves room
# for a loaded machine
CELL_TIMEOUT_S = 720.0


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


# how far R2's mean log10 KL may sit from no replay's: R2 replays the trainer's own routes, so its
# old pass is no replay's (the same KL at step 1, the same order of magnitude after); R3's is ~10
# decades below both
R2_LIKE_NO_REPLAY_DECADES = 1.0


def _decades_apart(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean log10 a - mean log10 b, their pooled standard deviation over steps)."""
    la, lb = [math.log10(max(v, 1e-30)) for v in a], [math.log10(max(v, 1e-30)) for v in b]
    return statistics.mean(la) - statistics.mean(lb), math.sqrt((statistics.variance(la) + statistics.variance(lb)) / 2)


def check_gate(cells: dict[str, list[dict]]) -> None:
    """The gate's assertions on the cells' step rows (``grpo``, ``grpo_r2``, ``grpo_r3``)."""
    off, r2, r3 = cells["grpo"], cells["grpo_r2"], cells["grpo_r3"]
    # the injector works: in every cell the rollout's routes differ from the trainer's own router
    for cell, rows in cells.items():
        rates = [m["mismatch/route_flip_rate"] for m in rows]
        assert all(0.01 < r < 0.3 for r in rates), (cell, rates)
    kl_off, kl_r2, kl_r3 = ([m["mismatch/kl_k3"] for m in rows] for rows in (off, r2, r3))
    # R3 computes with the rollout's routes: the same policy, to fp32 rounding, at every step
    assert max(kl_r3) < FLOOR, kl_r3
    assert min(m["mismatch/ess_frac"] for m in r3) > 1 - 1e-6
    # without replay and with R2, the trainer's router gives another policy at every step: the
    # injected mismatch stays, at least two decades above the floor (this set: 5e-7 to 3e-5)
    assert min(kl_off) > 100 * FLOOR, kl_off
    assert min(kl_r2) > 100 * FLOOR, ("R2 lost the injected mismatch (does it replay the rollout's routes?)", kl_r2)
    # the effect, in decades of KL (the scale it spans), against the spread over steps
    for name, kl in (("no replay", kl_off), ("R2", kl_r2)):
        effect, pooled_sd = _decades_apart(kl, kl_r3)
        assert effect > 2 * pooled_sd, (name, effect, pooled_sd, kl, kl_r3)
    # R2 keeps the mismatch no replay has, not a fraction of it
    gap, _ = _decades_apart(kl_r2, kl_off)
    assert abs(gap) < R2_LIKE_NO_REPLAY_DECADES, (gap, kl_r2, kl_off)


# the gate's own run (2026-12-07, 3 steps): per step the route-flip rate and the train/inference KL
# as its cells logged them (R2 equals no replay to these digits: its old pass is no replay's)
RECORDED = {
    "grpo": [(0.041, 4.8e-6), (0.043, 5.6e-7), (0.036, 2.5e-5)],
    "grpo_r2": [(0.041, 4.8e-6), (0.043, 5.6e-7), (0.036, 2.5e-5)],
    "grpo_r3": [(0.041, 5.1e-14), (0.042, 6.5e-14), (0.036, 3.9e-14)],
}


def _rows(pairs: list[tuple[float, float]]) -> list[dict]:
    """Step rows of a cell; ESS / N (asserted for R3 alone) is 1 at the floor, below it elsewhere."""
    return [{"mismatch/route_flip_rate": flip, "mismatch/kl_k3": kl, "mismatch/ess_frac": 1.0 if kl < FLOOR else 0.99}
            for flip, kl in pairs]


def test_the_gate_check_fails_when_r2_is_wired_like_r3_or_r3_like_r2():
    """The check is not vacuous (no training: the rows are the gate's own, then broken)."""
    cells = {name: _rows(pairs) for name, pairs in RECORDED.items()}
    check_gate(cells)
    # R2 replaying the rollout's routes, as R3 does: its cell is R3's
    with pytest.raises(AssertionError, match="R2 lost the injected mismatch"):
        check_gate({**cells, "grpo_r2": cells["grpo_r3"]})
    # R3 replaying the trainer's own routes, as R2 does: its cell is R2's
    with pytest.raises(AssertionError):
        check_gate({**cells, "grpo_r3": cells["grpo_r2"]})
    # R2 with a hundredth of no replay's mismatch left (a partial replay): two decades off
    with pytest.raises(AssertionError):
        check_gate({**cells, "grpo_r2": _rows([(f, kl * 1e-2) for f, kl in RECORDED["grpo_r2"]])})
    # the injector off: no route differs
    with pytest.raises(AssertionError):
        check_gate({**cells, "grpo": _rows([(0.0, kl) for _, kl in RECORDED["grpo"]])})


@pytest.mark.slow
def test_gate_r3_removes_the_injected_train_inference_mismatch_and_no_replay_and_r2_keep_it(tiny_data, tmp_path):
    cells = _run_cells(tiny_data, tmp_path, {"grpo": (), "grpo_r2": ("algorithm.routing_replay=r2",),
                                             "grpo_r3": ("algorithm.routing_replay=r3",)})
    for name, rows in cells.items():  # what the gate measured, in the test's log
        print(name, [(round(m["mismatch/route_flip_rate"], 3), f"{m['mismatch/kl_k3']:.2g}") for m in rows])
    check_gate(cells)
