"""The identity check of benchmarks/bench_study_step.py: how far two runs' metrics are apart."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_study_step.py"
spec = importlib.util.spec_from_file_location("bench_study_step", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

RUN = [{"step": 0, "val/em": 0.3}, {"step": 1, "actor/loss": 2.0, "note": "a"}, {"step": 2, "actor/loss": 1.0}]


def test_identical_runs_are_reported_identical():
    assert bench.compare(RUN, [list(RUN), list(RUN)]) == {}
    assert bench.describe({}) == "every non-timing metric of every step identical"


def test_a_drift_is_reported_with_its_size_and_first_step():
    drifted = [RUN[0], {**RUN[1], "actor/loss": 2.0 * (1 + 1e-6)}, {**RUN[2], "actor/loss": 1.1}]
    worst = bench.compare(RUN, [drifted])
    assert set(worst) == {"actor/loss"}
    rel, first = worst["actor/loss"]
    assert first == 1 and abs(rel - 0.1 / 1.1) < 1e-12  # the largest over the steps, from the first differing one
    assert "first at step 1" in bench.describe(worst)


def test_other_row_counts_and_non_numbers_are_named():
    assert bench.compare(RUN, [RUN[:2]]) is None
    assert bench.describe(None) == "DIFFERENT number of rows"
    worst = bench.compare(RUN, [[RUN[0], {**RUN[1], "note": "b"}, RUN[2]]])
    assert worst == {"note": (float("inf"), 1)}
