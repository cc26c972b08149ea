"""The precision stress's report (sorl_megatron/study/precision.py) on made-up runs: medians,
outcomes beside the fp32 counterpart, and each pre-registered prediction able to fail."""

from sorl_megatron.study.precision import predictions, report, run_summary


def _rows(kl: float, flip: float | None = None, em=(0.3, 0.5, 0.6)) -> list[dict]:
    rows = [{"step": 0, "val/em": em[0]}]
    for step in (1, 2, 3, 4):
        row = {"step": step, "mismatch/kl_k3": kl * step / 2}
        if flip is not None:
            row["mismatch/route_flip_rate"] = flip
        rows.append(row)
    rows += [{"step": 2, "val/em": em[1]}, {"step": 4, "val/em": em[2]}]
    return rows


def _record(r3_kl: float = 1e-4, flip: float = 0.01) -> dict:
    rec = {}
    for s in (1, 2, 3):
        rec[f"grpo__bf16__s{s}"] = _rows(1e-3)
        rec[f"grpo_r3__bf16__s{s}"] = _rows(r3_kl, flip)
        rec[f"grpo__control__s{s}"] = _rows(1e-13)
    return rec


def test_a_run_summary_is_its_medians_and_outcomes():
    got = run_summary(_rows(1e-3, 0.02, em=(0.4, 0.1, 0.1)))
    assert got["kl"] == 1e-3 * 2.5 / 2 and got["flip"] == 0.02
    assert got["fell"] == 1.0 and got["irreversible"] == 1.0 and got["final_em"] == 0.1


def test_the_predictions_hold_and_fail_with_the_numbers():
    ok = {n: run_summary(r) for n, r in _record().items()}
    assert all(held for _, held, _ in predictions(ok))
    no_drop = {n: run_summary(r) for n, r in _record(r3_kl=2e-3).items()}  # R3 above no replay
    held = {name[:2]: h for name, h, _ in predictions(no_drop)}
    assert held == {"P1": True, "P2": False, "P3": True, "P4": True}
    no_flip = {n: run_summary(r) for n, r in _record(flip=0.0).items()}
    assert [h for name, h, _ in predictions(no_flip) if name.startswith("P3")] == [False]


def test_the_report_sets_each_run_beside_its_fp32_counterpart_and_names_what_did_not_run():
    lines = report(_record())
    row = next(line for line in lines if line.startswith("| grpo__bf16__s2 "))
    assert row.endswith("| 1.25e-13, 0, 0.6 |")
    assert any(line.startswith("| grpo__bf16_lag2__s1 | not run") for line in lines)
    assert sum(line.endswith("| yes | " + line.split("| yes | ")[-1]) for line in lines if "| yes |" in line) == 4
