"""The tables of round three's indicator analysis (``early_warning.py`` writes them into
``results/study/round3/indicators.md``): round two's KL rule re-checked, step 1's KL, each
indicator's ROC per lead window with leave-one-seed-out, and the KL alarm's rates. The
scores, events and folds they read are ``indicators.py``'s."""

from __future__ import annotations

import math
from typing import Any, Optional

from .indicators import (
    LEAD_WINDOWS,
    ROC_SCORES,
    EventKind,
    Fold,
    Indicator,
    Sample,
    Score,
    auc,
    collapse_step,
    event_step,
    leave_one_seed_out,
    rates,
    reward_fall_step,
    run_seed,
    series,
    usable,
    window_samples,
)

POOLS: dict[str, str] = {"all": "", "route_lag2": "__route_lag2__"}  # pool -> the cell names it keeps
EVENTS: tuple[EventKind, ...] = ("validation", "reward")
KL_RULE = Indicator("mismatch/kl_k3", "above", 0.1)  # round two's "train/inference KL > 0.1"


def pool_runs(record: dict[str, list[dict[str, Any]]], pool: str) -> dict[str, list[dict[str, Any]]]:
    return {name: rows for name, rows in record.items() if POOLS[pool] in name}


def samples_for(runs: dict[str, list[dict[str, Any]]], score: Score, rise: bool, event: EventKind,
                window: tuple[int, int], collapse_fraction: float = 0.5) -> list[Sample]:
    out: list[Sample] = []
    for name, rows in runs.items():
        last = max(int(r["step"]) for r in rows)
        out += window_samples(name, score.scores(rows, rise), event_step(rows, event, collapse_fraction), last, window)
    return out


def alarm_samples(runs: dict[str, list[dict[str, Any]]], indicator: Indicator, event: EventKind,
                  window: tuple[int, int], start: int, collapse_fraction: float = 0.5) -> list[Sample]:
    """The fixed rule ``indicator`` as a 0/1 alarm at every step from ``start``."""
    out: list[Sample] = []
    for name, rows in runs.items():
        values = series(rows, indicator.metric)
        above = indicator.kind.endswith("above")
        alarm = {t: float(v > indicator.threshold if above else v < indicator.threshold)
                 for t, v in values.items() if t >= start}
        last = max(int(r["step"]) for r in rows)
        out += window_samples(name, alarm, event_step(rows, event, collapse_fraction), last, window)
    return out


def _g(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _first(s: dict[int, float], test, start: int = 1) -> Optional[int]:
    return next((t for t in sorted(s) if t >= start and test(s[t])), None)


def kl_crossings(rows: list[dict[str, Any]], threshold: float = 0.1) -> dict[str, Optional[int]]:
    """Where ``mismatch/kl_k3`` first passed ``threshold``: at any step (``any``), from step 2
    (``from2``), and by its rise over the run's own step-1 value, from step 2 (``rise``)."""
    kl = series(rows, "mismatch/kl_k3")
    k1 = kl.get(1)
    return {"any": _first(kl, lambda v: v > threshold), "from2": _first(kl, lambda v: v > threshold, 2),
            "rise": None if k1 is None else _first(kl, lambda v: v - k1 > threshold, 2)}


def kl_rule_section(record: dict[str, list[dict[str, Any]]], collapse_fraction: float = 0.5) -> list[str]:
    """Round two's reading of ``mismatch/kl_k3 > 0.1`` redone: per fallen run, where it crossed
    (at step 1, or from step 2, and against the run's own step-1 value), and the stable runs that
    crossed too."""
    fell = {name: collapse_step(rows, collapse_fraction) for name, rows in record.items()}
    cross = {name: kl_crossings(rows) for name, rows in record.items()}

    def before(name: str, key: str) -> bool:
        t = cross[name][key]
        return t is not None and (fell[name] is None or t <= fell[name])

    summary = []
    for label, names in (("At `route_lag2`", [n for n in record if "__route_lag2__" in n]),
                         ("In the other cells", [n for n in record if "__route_lag2__" not in n])):
        down = [n for n in names if fell[n] is not None]
        up = [n for n in names if fell[n] is None]
        summary.append(
            f"{label} ({len(names)} runs): of the {len(down)} whose validation EM fell, the train/inference KL "
            f"crossed 0.1 at step 1 in {sum(cross[n]['any'] == 1 for n in down)}, crossed it from step 2 at or "
            f"before the fall in {sum(before(n, 'from2') for n in down)}, and rose by more than 0.1 over its own "
            f"step-1 value at or before the fall in {sum(before(n, 'rise') for n in down)}; of the {len(up)} "
            f"that did not fall, {sum(before(n, 'any') for n in up)} crossed 0.1, "
            f"{sum(before(n, 'from2') for n in up)} from step 2, and {sum(before(n, 'rise') for n in up)} rose "
            "by more than 0.1 over their step-1 value.")
    lines = ["| run | EM fell at (validation) | reward fell at (3-step mean) | KL at step 1 | KL > 0.1 first "
             "| from step 2 | KL - its step-1 value > 0.1, first | ESS / N < 0.5, first "
             "| KL(old ‖ new) > 0.05, first |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in sorted((n for n in record if fell[n] is not None), key=lambda n: (n.rsplit("__", 2)[1], n)):
        rows, t_fell = record[name], fell[name]

        def shown(t: Optional[int]) -> str:
            return "-" if t is None else (f"{t} (lead {t_fell - t})" if t <= t_fell else f"{t} (after)")

        c = cross[name]
        lines.append(f"| {name} | {t_fell} | {reward_fall_step(rows, collapse_fraction) or '-'} "
                     f"| {_g(series(rows, 'mismatch/kl_k3').get(1), 3)} "
                     f"| {shown(c['any'])} | {shown(c['from2'])} | {shown(c['rise'])} "
                     f"| {shown(_first(series(rows, 'mismatch/ess_frac'), lambda v: v < 0.5, 2))} "
                     f"| {shown(_first(series(rows, 'actor/approx_kl_k3'), lambda v: v > 0.05, 2))} |")
    return [" ".join(summary), ""] + lines + [""]


def step1_kl_section(record: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Step 1's train/inference KL by seed over the injected runs without R3: it is the seed's, not
    the run's (every run of a seed samples step 1's batch from the same policy)."""
    by_seed: dict[int, list[float]] = {}
    for name, rows in record.items():
        if "route" in name.rsplit("__", 2)[1] and not name.startswith("grpo_r3__"):
            v = series(rows, "mismatch/kl_k3").get(1)
            if v is not None:
                by_seed.setdefault(run_seed(name), []).append(v)
    return [("Step 1's train/inference KL in the injected runs without R3, by seed (min-max over the runs): "
             + "; ".join(f"seed {s}: {min(v):.4f}-{max(v):.4f} ({len(v)} runs)" for s, v in sorted(by_seed.items()))
             + ". Every run of a seed samples step 1's batch from the start policy with the same injection, so "
               "a crossing at step 1 is the seed's, whatever the loss or the outcome."), ""]


def roc_tables(record: dict[str, list[dict[str, Any]]]) -> tuple[list[str], list[str]]:
    """(the AUC tables, the rules that survive leave-one-seed-out)."""
    lines: list[str] = []
    survivors: list[str] = []
    for pool in POOLS:
        runs = pool_runs(record, pool)
        for event in EVENTS:
            n_events = sum(event_step(rows, event, 0.5) is not None for rows in runs.values())
            lines += [f"#### Pool `{pool}` ({len(runs)} runs), events timed by {event} ({n_events} runs fell)", "",
                      "| indicator | score | " + " | ".join(f"{a}-{b} steps ahead" for a, b in LEAD_WINDOWS) + " |",
                      "|---|---|" + "---|" * len(LEAD_WINDOWS)]
            for name, score in ROC_SCORES.items():
                for rise in (False, True):
                    cells = []
                    for window in LEAD_WINDOWS:
                        samples = samples_for(runs, score, rise, event, window)
                        folds = leave_one_seed_out(samples)
                        held = [f.auc for f in folds if f.auc is not None]
                        ok = usable(folds)
                        pos = sum(s.label for s in samples)
                        cells.append(f"{_g(auc(samples))} [{_g(min(held) if held else None)}-"
                                     f"{_g(max(held) if held else None)}]" + (" **usable**" if ok else "")
                                     + f" ({pos}/{len(samples) - pos})")
                        if ok:
                            survivors.append(_survivor(pool, event, name, rise, window, folds))
                    lines.append(f"| {name} | {'rise from step 1' if rise else 'value'} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines, survivors


def _survivor(pool: str, event: str, name: str, rise: bool, window: tuple[int, int], folds: list[Fold]) -> str:
    score = ROC_SCORES[name]
    what = f"{score.metric} {'rise from step 1' if rise else 'value'}"
    per = "; ".join(
        f"seed {f.seed}: {'reversed, ' if f.flipped else ''}threshold {f.threshold:.4g} (on the score), "
        f"AUC {f.auc:.2f}, TPR {f.rates.tpr:.2f}, FPR {f.rates.fpr:.2f}, precision {_g(f.rates.precision)}"
        for f in folds if f.rates is not None and f.threshold is not None and f.auc is not None)
    return f"- pool `{pool}`, {event}-timed, {window[0]}-{window[1]} steps ahead, {what}: {per}"


def kl_alarm_table(record: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["| pool | events | counted from | " + " | ".join(f"{a}-{b} steps: AUC / TPR / FPR / false alarms"
                                                          for a, b in LEAD_WINDOWS) + " |",
             "|---|---|---|" + "---|" * len(LEAD_WINDOWS)]
    for pool in POOLS:
        runs = pool_runs(record, pool)
        for event in EVENTS:
            for start in (1, 2):
                cells = []
                for window in LEAD_WINDOWS:
                    s = alarm_samples(runs, KL_RULE, event, window, start)
                    r = rates(s, 1.0)
                    false = None if r.precision is None else 1 - r.precision
                    cells.append(f"{_g(auc(s))} / {_g(r.tpr)} / {_g(r.fpr)} / {_g(false)}")
                lines.append(f"| {pool} | {event} | step {start} | " + " | ".join(cells) + " |")
    return lines + [""]
