"""Round three's leading-indicator analysis (issue 47, item 2): does any per-step indicator warn of
a fall in time to act? The analysis is ``indicators.py``'s; this module writes its document and
figures from a study record:

    python -m sorl_megatron.study.early_warning --record results/study/round2 \
        --record results/study/round2_mechanism --out results/study/round3/indicators.md

(``--figures DIR``: the figures' directory, default ``figures`` beside ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .indicators import (
    FIRST_SCORED_STEP,
    REWARD_WINDOW,
    USABLE_AUC,
    USABLE_FPR,
    USABLE_TPR,
    collapse_step,
    load_record,
    reward_fall_step,
    run_seed,
    series,
)
from .warning_report import (
    POOLS,
    kl_alarm_table,
    kl_rule_section,
    roc_tables,
    step1_kl_section,
)

# (metric, column title, log axis, fixed range) of the figures, EM first
FIGURE_COLUMNS: tuple[tuple[str, str, bool, Optional[tuple[float, float]]], ...] = (
    ("val/em", "validation EM", False, (0.0, 1.0)),
    ("rollout/reward", "training reward", False, (0.0, 1.0)),
    ("mismatch/kl_k3", "train/inference KL (k3)", True, None),
    ("actor/approx_kl_k3", "KL(old ‖ new) (k3)", True, None),
    ("mismatch/ess_frac", "ESS / N", False, (0.0, 1.02)),
    ("mismatch/route_flip_rate", "route-flip rate", False, None),
    ("actor/clip_frac/token", "clip fraction, tokens", False, None),
    ("actor/clip_frac/turn", "clip fraction, turns", False, None),
)
# figure -> its rows, (loss, stress) each
FIGURE_GROUPS: dict[str, tuple[tuple[str, str], ...]] = {
    "route_lag2_grpo": tuple((loss, "route_lag2") for loss in (
        "grpo", "grpo_r3", "grpo_tis", "grpo_mis", "sapo", "gspo", "so_grpo", "so_grpo_dc", "so_grpo_relative")),
    "route_lag2_ppo": tuple((loss, "route_lag2") for loss in ("ppo", "turn_ppo", "so_ppo")),
    "mid": tuple((loss, "mid") for loss in ("ppo", "turn_ppo", "so_ppo")),
    "route_no_lag": tuple((loss, stress) for stress in ("route", "route_4x")
                          for loss in ("grpo", "grpo_r2", "grpo_r3")),
}
SEED_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def figures(record: dict[str, list[dict[str, Any]]], fig_dir: Path, collapse_fraction: float = 0.5) -> list[Path]:
    """One PNG per group: a row per cell, a column per metric (EM first), one line per seed; the
    validation at which EM fell a dashed line, the step at which the training reward fell a dotted
    one, in the seed's colour; every panel of a column on the same y range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    fig_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, cells in FIGURE_GROUPS.items():
        rows_of = {cell: sorted((n for n in record if n.startswith(f"{cell[0]}__{cell[1]}__s")), key=run_seed)
                   for cell in cells}
        cells = tuple(c for c in cells if rows_of[c])
        if not cells:
            continue
        seeds = sorted({run_seed(n) for c in cells for n in rows_of[c]})
        fig, axes = plt.subplots(len(cells), len(FIGURE_COLUMNS), figsize=(1.95 * len(FIGURE_COLUMNS),
                                 1.3 * len(cells) + 0.9), sharex=True, sharey="col", squeeze=False)
        for r, cell in enumerate(cells):
            for c, (metric, title, log, fixed) in enumerate(FIGURE_COLUMNS):
                ax = axes[r][c]
                drawn = False
                for name in rows_of[cell]:
                    rows = record[name]
                    colour = SEED_COLOURS[seeds.index(run_seed(name)) % len(SEED_COLOURS)]
                    s = series(rows, metric)
                    if log:
                        s = {t: v for t, v in s.items() if v > 0}
                    if s:
                        ts = sorted(s)
                        ax.plot(ts, [s[t] for t in ts], color=colour, lw=0.9,
                                marker="o" if metric == "val/em" else None, ms=2)
                        drawn = True
                    fell, rfell = collapse_step(rows, collapse_fraction), reward_fall_step(rows, collapse_fraction)
                    if fell is not None:
                        ax.axvline(fell, color=colour, ls="--", lw=0.8)
                    if rfell is not None:
                        ax.axvline(rfell, color=colour, ls=":", lw=1.0)
                if log:
                    ax.set_yscale("log")
                    ax.yaxis.set_minor_formatter(NullFormatter())
                if fixed:
                    ax.set_ylim(*fixed)
                if not drawn:
                    ax.text(0.5, 0.5, "not logged\n(no injection)" if "route" in metric else "not logged",
                            transform=ax.transAxes, ha="center", va="center", fontsize=6, color="grey")
                if r == 0:
                    ax.set_title(title, fontsize=9)
                if c == 0:
                    ax.set_ylabel(f"{cell[0]}\n{cell[1]}", fontsize=8)
                if r == len(cells) - 1:
                    ax.set_xlabel("RL step", fontsize=7)
                ax.tick_params(labelsize=6)
                ax.grid(alpha=0.25)
        handles = [Line2D([], [], color=SEED_COLOURS[i % len(SEED_COLOURS)], lw=1.2, label=f"seed {s}")
                   for i, s in enumerate(seeds)]
        handles += [Line2D([], [], color="black", ls="--", lw=0.8, label="validation EM fell (study rule)"),
                    Line2D([], [], color="black", ls=":", lw=1.0,
                           label=f"training reward fell ({REWARD_WINDOW}-step mean, same rule)")]
        fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (1.3 * len(cells) + 0.9)))
        path = fig_dir / f"indicators_{group}.png"
        fig.savefig(path, dpi=72)
        plt.close(fig)
        written.append(path)
    return written


def reading(survivors: Sequence[str]) -> str:
    """What the surviving rules (``roc_tables``' list) amount to, in words."""
    early = [r for r in survivors if " 1-4 steps ahead" not in r]
    short = [r for r in survivors if " 1-4 steps ahead" in r]
    text = ("No rule survives at 5 or more steps ahead, in either pool, for either timing of the falls: "
            "**no indicator gives an early warning here**. " if not early else
            f"{len(early)} rule(s) survive at 5 or more steps ahead (listed above). ")
    if short:
        stressed = [r for r in short if "pool `route_lag2`" in r]
        text += (f"{len(short)} rule(s) survive at 1-4 steps ahead, {len(stressed)} of them within `route_lag2`. "
                 "That lead is within the events' own timing: a validation comes every 5 steps (4 at `mid`), so "
                 "a fall dated by validation happened up to 4 steps before it, and the reward's 3-step mean "
                 "dates a fall up to 2 steps after its first low step; such a rule may see a fall as it starts "
                 "rather than foresee it. In the pool of all runs, part of what a rule scores is telling the "
                 "stressed cells (where the falls are) from the unstressed ones.")
    return text


def document(record: dict[str, list[dict[str, Any]]], command: str, figure_paths: Sequence[Path],
             out: Path) -> list[str]:
    tables, survivors = roc_tables(record)
    n_runs = {pool: sum(1 for n in record if key in n) for pool, key in POOLS.items()}
    lines = [
        "# Round three: the leading indicators, redone (issue 47, item 2)", "",
        "Generated from the committed record of policy B's runs; regenerate with", "", "```bash", command, "```", "",
        "## What is measured", "",
        f"**Runs.** Every committed run of policy B: {n_runs['all']} runs (round two's grids, 60 steps, validation "
        "every 5, and the mechanism grid, 12 steps, validation every 4), and the pool of the "
        f"{n_runs['route_lag2']} runs at `route_lag2`, the stress under which all of the 60-step runs' falls "
        "happened (in the pool of all runs, an indicator can also score by telling stressed runs from unstressed "
        "ones).", "",
        "**Events.** A run's fall is timed two ways: by validation EM (the study's rule: the first validation "
        "below half the best before it), and by the per-step training reward (the same rule on its trailing "
        f"{REWARD_WINDOW}-step mean: the raw per-step reward swings 2x between consecutive steps of the same seed "
        "in runs that never fall, e.g. the controls' seed 2 at steps 5-6, because the batches' difficulty "
        "differs). In lagged runs the reward of step k was earned by the weights of step k - 2.", "",
        f"**Scores.** From step {FIRST_SCORED_STEP} on (step 1's batch is the same in every run of a seed): each "
        "indicator's value, and its change from the run's own step-1 value (difference; for the gradient norm "
        "and the entropy, the log of the ratio). Direction: higher is more alarming for KL, clip fractions, "
        "route flips and the gradient norm, lower for ESS and entropy (entropy's was fixed before the runs as "
        "a fall; its AUC below 0.5 says it rises instead).", "",
        "**ROC per lead window.** A sample is a (run, step t) before the run's fall: positive when the fall "
        "comes a to b steps after t, negative when no fall comes within b steps (steps whose fall is nearer "
        "than a, steps at or after the fall, and steps whose window runs past the run's end are left out). "
        "AUC over all samples of the pool, then **leave one seed out**: the direction and the threshold "
        "(largest TPR - FPR) fitted on the other two seeds, judged on the held-out one (every run of a seed "
        "shares its data order and its first batch, so a seed is the unit that generalizes). A rule is "
        f"**usable** when on every held-out seed its AUC is >= {USABLE_AUC}, and the fitted threshold catches "
        f">= {USABLE_TPR:.0%} of the held-out seed's positive steps with <= {USABLE_FPR:.0%} of its negative "
        "steps alarmed. Samples within a run are not independent, and 10 indicators x 2 scores x 3 windows x "
        "2 events x 2 pools are 240 tries: a rule that passes once is a candidate, not a finding.", "",
        "## Round two's rule, `mismatch/kl_k3 > 0.1`, rechecked", "",
    ]
    lines += step1_kl_section(record) + kl_rule_section(record)
    lines += ["The same rule as a per-step alarm (alarm when KL > 0.1 at step t), counted from step 1 and from "
              "step 2; \"false alarms\": the share of alarmed steps not followed by a fall within the window.",
              ""] + kl_alarm_table(record)
    lines += ["## Every indicator: ROC AUC per lead window", "",
              "Each cell: AUC over the pool [lowest-highest AUC on a held-out seed] (positive / negative samples); "
              "**usable** marks a rule that passes the leave-one-seed-out test above.", ""] + tables
    lines += ["## Rules that survive leave-one-seed-out", ""]
    lines += survivors if survivors else ["None."]
    lines += ["", "**Reading.** " + reading(survivors), ""]
    lines += ["## Figures", "",
              "A row per cell, a column per metric, one line per seed; dashed: the validation at which EM fell, "
              "dotted: the step at which the training reward's 3-step mean fell; every panel of a column on one "
              "y range.", ""]
    lines += [f"![{p.stem}]({os.path.relpath(p, out.parent)})" for p in figure_paths] + [""]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sorl_megatron.study.early_warning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="append", required=True,
                        help="a study record directory (holding runs/<cell>/metrics.jsonl); repeat to merge")
    parser.add_argument("--out", required=True, help="the Markdown document to write")
    parser.add_argument("--figures", default=None, help="the figures' directory (default: figures beside --out)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        record = load_record(args.record)
    except (FileNotFoundError, ValueError) as err:
        print(f"early_warning: {err}", file=sys.stderr)
        return 2
    fig_dir = Path(args.figures) if args.figures else out.parent / "figures"
    command = ("python -m sorl_megatron.study.early_warning " + " ".join(f"--record {r}" for r in args.record)
               + f" --out {args.out}" + (f" --figures {args.figures}" if args.figures else ""))
    paths = figures(record, fig_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(document(record, command, paths, out)))
    print(f"[early_warning] {out} and {len(paths)} figures under {fig_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
