"""Round three's confirmation analysis (sorl_megatron/study/confirm.py): the outcomes, the paired
test and the verdict on hand-made runs, and the whole table on round two's committed record (its
inputs are real runs)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from sorl_megatron.study import confirm
from sorl_megatron.study.confirm import (
    Comparison,
    bootstrap_ci,
    compare,
    holm,
    paired_test,
    run_outcomes,
    sign_flip_p,
    verdict,
)

ROOT = Path(__file__).resolve().parents[1]
RECORDS = [ROOT / "results/study/round2", ROOT / "results/study/round2_mechanism"]


def _run(em: dict[int, float]) -> list[dict]:
    return [{"step": t, "val/em": v} for t, v in sorted(em.items())]


def test_outcomes_tell_a_transient_dip_from_an_irreversible_collapse():
    none = run_outcomes(_run({0: 0.3, 5: 0.5, 10: 0.6}))
    assert (none["fell"], none["irreversible"], none["transient"]) == (0, 0, 0)
    assert none["final_em"] == 0.6 and none["em_area"] == pytest.approx((0.4 + 0.55) / 2)
    dip = run_outcomes(_run({0: 0.3, 5: 0.6, 10: 0.2, 15: 0.5}))  # 0.2 < 0.3 = half of 0.6; back to 0.5
    assert (dip["fell"], dip["irreversible"], dip["transient"], dip["fell_at"]) == (1, 0, 1, 10)
    down = run_outcomes(_run({0: 0.3, 5: 0.6, 10: 0.2, 15: 0.5, 20: 0.1}))  # fell, recovered, down at the end
    assert (down["fell"], down["irreversible"], down["transient"]) == (1, 1, 0)
    low = run_outcomes(_run({0: 0.04, 5: 0.0}))  # a best below 0.05 cannot fall
    assert (low["fell"], low["irreversible"]) == (0, 0)
    with pytest.raises(ValueError, match="validations"):
        run_outcomes(_run({0: 0.3}))


def test_sign_flip_p_is_exact():
    assert sign_flip_p([1, 1, 1]) == 2 / 8  # all + or all -
    assert sign_flip_p([1, -1]) == 1.0
    assert sign_flip_p([0, 0, 0]) == 1.0
    assert sign_flip_p([1, 1, 1, 1, 1, 1, 0, 0]) == 2 / 64  # zero differences do not count
    assert sign_flip_p([0.5, 0.2, 0.1]) == 2 / 8
    assert sign_flip_p([0.5, 0.2, -0.1]) == 4 / 8  # |0.5 + 0.2 - 0.1| is reached by ++-, --+, +++, ---


def test_bootstrap_is_seeded_and_holm_steps_down():
    assert bootstrap_ci([0.2] * 5) == (0.2, 0.2)
    lo, hi = bootstrap_ci([1, 0, 0, -1, 1, 1])
    assert lo < 1 / 3 < hi and (lo, hi) == bootstrap_ci([1, 0, 0, -1, 1, 1])
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5]
    t = paired_test([1, 1, 0, 1], [0, 0, 0, 0])
    assert (t.n, t.diff, t.p) == (4, 0.75, 2 / 8)
    assert t.d_z == pytest.approx(0.75 / 0.5)


def _record(arm_fell: list[int], base_fell: list[int]) -> dict[str, list[dict]]:
    """A record of two losses at one stress level: a fall is EM 0 at step 10, else 0.6."""
    record = {}
    for loss, falls in (("x", arm_fell), ("base", base_fell)):
        for seed, fell in enumerate(falls, 1):
            record[f"{loss}__s__s{seed}"] = _run({0: 0.3, 5: 0.6, 10: 0.0 if fell else 0.6})
    return record


def test_verdict_follows_the_preregistered_rule():
    comp = Comparison("Q", "x", "base", "s", -1, 10)
    seeds = range(1, 17)
    # 10 of 16 seeds: the baseline fell and the arm did not; never the other way round
    confirmed = compare(_record([0] * 16, [1] * 10 + [0] * 6), [comp], seeds)[0]
    assert confirmed.tests["fell"].diff == pytest.approx(-10 / 16)
    assert confirmed.tests["fell"].p == pytest.approx(2 / 2**10)
    assert verdict(confirmed) == "confirmed"
    # a difference in the committed seeds 1-3 alone: p = 2/8 at best, not confirmed
    only_old = compare(_record([0] * 16, [1] * 3 + [0] * 13), [comp], seeds)[0]
    assert only_old.new_only["fell"].diff == 0 and verdict(only_old) == "not confirmed"
    # the guard on the new seeds: a significant difference that the new seeds alone do not share
    guarded = dataclasses.replace(confirmed, new_only={"fell": paired_test([1, 0], [0, 0])})
    assert verdict(guarded) == "not confirmed (new seeds alone disagree)"
    opposite = compare(_record([1] * 10 + [0] * 6, [0] * 16), [comp], seeds)[0]
    assert verdict(opposite) == "opposite"
    # a missing or short cell leaves its pair out and is named
    record = _record([0] * 4, [1] * 4)
    del record["x__s__s2"]
    record["base__s__s3"] = record["base__s__s3"][:2]
    short = compare(record, [comp], seeds=range(1, 5))[0]
    assert short.seeds == [1, 4] and "x__s__s2" in short.missing
    assert any(m.startswith("base__s__s3 (last validation 5)") for m in short.missing)


def test_the_table_on_round_two_record():
    """The table from the committed record (seeds 1-3 of policy B): its numbers are docs/study.md's."""
    record = confirm.load_record(RECORDS)
    results = {r.comparison.name: r for r in compare(record, seeds=range(1, 4))}
    tis = results["grpo_tis vs grpo at route_lag2"]
    assert tis.seeds == [1, 2, 3]
    assert tis.tests["fell"].arm_mean == pytest.approx(1 / 3) and tis.tests["fell"].base_mean == pytest.approx(2 / 3)
    assert tis.tests["final_em"].base_mean == pytest.approx(0.771, abs=5e-4)  # GRPO 0.771 ± 0.029
    assert tis.tests["final_em"].arm_mean == pytest.approx(0.692, abs=5e-4)  # TIS 0.692 ± 0.20
    mid = results["turn_ppo vs ppo at mid"]
    assert (mid.tests["fell"].arm_mean, mid.tests["fell"].base_mean) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    # three seeds cannot reach p < 0.05: the smallest exact p with 3 pairs is 2/8
    assert all(r.tests["fell"].p >= 0.25 for r in results.values())
    assert all(verdict(r) == "not confirmed" for r in results.values())
    # the count: of policy B's 18 falls (round two's grids, 60 steps), 12 are transient dips
    outcomes = [run_outcomes(rows) for name, rows in record.items() if "__mid__" not in name
                and "__low__" not in name]
    assert sum(o["fell"] for o in outcomes) == 18
    assert sum(o["transient"] for o in outcomes) == 12 and sum(o["irreversible"] for o in outcomes) == 6


def test_cli_writes_the_table(tmp_path, capsys):
    out = tmp_path / "confirmation.md"
    assert confirm.main(["--record", str(RECORDS[0]), "--record", str(RECORDS[1]), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| Q2 | sapo vs grpo at route_lag2 | fell | 3 (1-3) |" in text
    assert "grpo__route_lag2 seeds 4-16" in text  # the new seeds are named until they exist
    assert "| turn_ppo__route_lag2__s2 | yes (30) | yes | no | 0.038 |" in text
    assert confirm.main(["--record", str(tmp_path / "nothing")]) == 2
    assert "no record" in capsys.readouterr().err
    assert math.isclose(confirm.bootstrap_ci([1.0, 0.0])[0], 0.0)
