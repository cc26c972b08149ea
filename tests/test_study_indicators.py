"""The study's leading-indicator analysis (sorl_megatron/study/indicators.py) on hand-made runs."""

from __future__ import annotations

import pytest

from sorl_megatron.study.indicators import (
    Indicator,
    collapse_step,
    indicator_report,
    run_warnings,
    separating,
)
from sorl_megatron.study.runner import load_study


def _run(em: dict[int, float], **metrics: dict[int, float]) -> list[dict]:
    steps = sorted(set(em) | {t for m in metrics.values() for t in m})
    rows = []
    for t in steps:
        row = {"step": t}
        if t in em:
            row["val/em"] = em[t]
        for key, values in metrics.items():
            if t in values:
                row[key.replace("__", "/")] = values[t]
        rows.append(row)
    return rows


INDICATORS = {"kl": Indicator("actor/kl", "above", 0.1), "gn": Indicator("actor/gn", "rel_above", 5.0, 2),
              "ent": Indicator("actor/ent", "rel_below", 0.5, 2)}


def test_collapse_step_is_the_first_validation_below_the_fraction_of_the_best_before():
    assert collapse_step(_run({0: 0.4, 4: 0.6, 8: 0.35, 12: 0.2}), 0.5) == 12  # 0.35 is not < 0.3
    assert collapse_step(_run({0: 0.4, 4: 0.6, 8: 0.35, 12: 0.2}), 0.6) == 8
    assert collapse_step(_run({0: 0.04, 4: 0.0}), 0.5) is None  # a best below 0.05 cannot collapse
    assert collapse_step(_run({0: 0.4, 4: 0.5}), 0.5) is None


def test_leads_first_indicator_and_the_separating_ones():
    collapsed = _run({0: 0.4, 4: 0.4, 8: 0.1},
                     actor__kl={1: 0.01, 2: 0.2, 3: 0.5},  # crosses at 2: lead 6
                     actor__gn={1: 1.0, 2: 1.0, 3: 1.2, 5: 6.0, 9: 50.0},  # baseline 1.0: crosses at 5 (lead 3)
                     actor__ent={1: 2.0, 2: 2.0, 9: 0.1})  # crosses only after the collapse: no lead
    stable = _run({0: 0.4, 4: 0.45, 8: 0.5}, actor__kl={1: 0.01, 2: 0.02}, actor__gn={1: 1.0, 2: 1.0, 7: 9.0},
                  actor__ent={1: 2.0, 2: 2.0, 3: 1.9})
    w_c = run_warnings("grpo__s__s1", collapsed, INDICATORS, 0.5)
    w_s = run_warnings("grpo__s__s2", stable, INDICATORS, 0.5)
    assert w_c.collapsed_at == 8 and w_s.collapsed_at is None
    assert w_c.crossed_at == {"kl": 2, "gn": 5, "ent": 9}
    assert w_c.leads() == {"kl": 6, "gn": 3, "ent": None}
    assert w_c.first() == ["kl"]
    assert w_s.crossed_at == {"kl": None, "gn": 7, "ent": None}
    # kl crossed in the collapsed run and not in the stable one; gn crossed in both
    assert separating([w_c, w_s]) == ["kl"]
    assert separating([w_c]) == []  # nothing to tell apart without a stable run
    report = "\n".join(indicator_report([w_c, w_s], INDICATORS))
    assert "| grpo__s__s1 | 8 | 6 | 3 | - | kl |" in report
    assert "in none of the 1 stable ones: **kl**." in report
    assert indicator_report([w_s], INDICATORS)[-2] == "No run collapsed."


def test_bad_indicators_are_config_errors(tmp_path):
    from sorl_megatron.common.typed_config import ConfigError

    with pytest.raises(ValueError, match="kind must be"):
        Indicator("x", "sideways", 1.0)
    with pytest.raises(ValueError, match="relative threshold"):
        Indicator("x", "rel_above", 0.0)
    path = tmp_path / "s.yaml"
    path.write_text("recipe: x.yaml\nstart_policy: p\nlosses: {a: []}\nstress: {b: []}\n"
                    "indicators: {kl: {metric: actor/kl, kind: above, treshold: 1}}\n")
    with pytest.raises(ConfigError, match="treshold"):
        load_study(path)
    path.write_text("recipe: x.yaml\nstart_policy: p\nlosses: {a: []}\nstress: {b: []}\n"
                    "indicators: {kl: {metric: actor/kl, kind: above, threshold: 0.3}}\n")
    assert load_study(path).indicators == {"kl": Indicator("actor/kl", "above", 0.3)}
