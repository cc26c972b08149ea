"""A stability study: a grid of losses x off-policy stress levels x seeds, one training run per
cell, all from one shared starting policy; resumable; summarized with a band over seeds.

    python -m sorl_megatron.study --config recipes/study/tiny_stability.yaml [--parallel N]

A study recipe (YAML) names the training recipe every cell starts from, the starting policy
(e.g. the CPU demo's SFT model), the grid, and overrides applied to every cell. Each cell is
``python -m sorl_megatron.train`` in its own process, writing ``<out>/runs/<loss>__<stress>__s<seed>``.
A cell whose metrics reach ``schedule.total_steps`` is done and skipped; an interrupted one
resumes from its last checkpoint (``checkpoint.resume=auto``), so re-running the command
continues the study. ``<out>/summary.md`` and ``<out>/figures/*.png`` (the recipe's ``summary``
and ``figures``) are rewritten at the end (``--summarize`` does only that). ``--export DIR``
writes the grid's record (each run's metrics cut to what the summary reads) under ``DIR/runs``,
small enough to commit; ``--summarize out=DIR`` summarizes from it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import fnmatch
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from ..common.cli_range import count
from ..common.run_lock import RunLockError, acquire_run_lock
from ..common.typed_config import ConfigError, build_dataclass
from ..trainer.metrics.logger import read_metrics
from ..trainer.metrics.plots import METRIC_AXES, identical_curves, identical_note, line_style, style_axis, symbol_notes
from ..trainer.recipe.loader import load_recipe, overrides_tree
from ..trainer.recipe.run_settings import run_settings_problem
from ..trainer.rerun import rerun_plan
from ..trainer.serving.servers import SignalInterrupt
from .indicators import DEFAULT_INDICATORS, Indicator, collapse_step, indicator_report, run_warnings
from .indicators import series as metric_series

# What the summary plots and tables (SORL Figs. 2-8): score, KL, clip ratio, gradient norm, ||C||.
FIGURE_METRICS: dict[str, str] = {
    "val/em": "validation exact match",
    "rollout/reward": "training reward",
    "actor/approx_kl_k3": "KL(pi_old || pi), k3",
    "actor/clip_frac": "clip ratio",
    "actor/grad_norm": "gradient norm (before clipping)",
    "actor/clip_bias/logprob_norm": "clip-bias norm ||C|| (log-prob space)",
    "actor/clip_bias/factor": "clip-bias normalization factor",
}

# What a study's record keeps of each run besides FIGURE_METRICS and the indicators' metrics:
# what docs/study.md's tables read (validation, train/inference mismatch, staleness, the clip
# fraction by unit, the advantage's sign mixing). Timings, batching and histograms stay in the run.
RECORD_KEYS = ("val/em", "val/reward", "rollout/response_length", "rollout/valid_action_turn_frac",
               "rollout/version_lag_max", "mismatch/kl_k3", "mismatch/ess_frac", "mismatch/ess_frac_seq",
               "mismatch/route_flip_rate", "actor/clip_frac/token", "actor/clip_frac/turn", "actor/clip_bias/norm",
               "actor/entropy/mean", "actor/turn_ratio/spread", "actor/advantage/mean", "actor/advantage/var",
               "actor/advantage/turn_sign_mixed_frac", "actor/is/ess_token", "actor/is/ess_turn",
               "actor/is/ess_sequence")


MAX_PARALLEL = 1024  # cells at once (the --parallel flag's bound too)
MAX_STOP_TIMEOUT_S = 3600.0  # how long a stopped cell may take to exit
MAX_CELL_NAME_BYTES = 200  # a run directory and logging.run_name (the recipe's own bound)


@dataclass
class StudyConfig:
    """A study recipe. ``recipe`` is relative to the study file; ``start_policy``, ``data`` and
    ``out`` to the working directory (the repository root, as the demo's ``runs/``).

    recipe: the training recipe every cell starts from.
    start_policy: HF directory of the shared starting policy (``model.path`` of every cell,
        SFT off); the CPU demo's is ``runs/tiny_search/so_grpo/sft_model``.
    data: the synthetic set (``runs/tiny``: corpus, train / validation parquet).
    losses / stress: name -> overrides of that loss / off-policy stress level.
    seeds: ``schedule.seed`` of each repetition.
    overrides: applied to every cell (after the loss's and the stress level's).
    parallel: cells run at once (each is a trainer with its own servers).
    collapse_fraction: a run *collapses* when a validation EM after its first falls below this
        fraction of the best validation EM it reached before (and that best was >= 0.05).
    stop_timeout_s: after Ctrl-C (or SIGTERM), how long each running cell may take to stop
        its servers and exit before it is killed.
    indicators: name -> leading indicator (``study_indicators.Indicator``) for the summary's
        "which warned first" table; the defaults when not given.
    summary / figures: the summary file and the figures' directory, relative to ``out``: studies
        that share an ``out`` (and so the cells they both name) keep their own summaries.
    """

    recipe: str
    start_policy: str
    data: str = "runs/tiny"
    out: str = "runs/study"
    losses: dict[str, list[str]] = field(default_factory=dict)
    stress: dict[str, list[str]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [1])
    overrides: list[str] = field(default_factory=list)
    parallel: int = 1
    collapse_fraction: float = 0.5
    stop_timeout_s: float = 120.0
    indicators: dict[str, Indicator] = field(default_factory=lambda: dict(DEFAULT_INDICATORS))
    summary: str = "summary.md"
    figures: str = "figures"

    def __post_init__(self) -> None:
        if not self.losses or not self.stress or not self.seeds:
            raise ValueError("losses, stress and seeds must each name at least one entry")
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel must be in [1, {MAX_PARALLEL}], got {self.parallel}")
        if not 0 < self.collapse_fraction < 1:
            raise ValueError(f"collapse_fraction must be in (0, 1), got {self.collapse_fraction}")
        for group in (self.losses, self.stress):
            bad = [n for n in group if "__" in n or "/" in n]
            if bad:
                raise ValueError(f"names may not contain '__' or '/': {bad}")
        repeated = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
        if repeated:  # two cells would be one run directory
            raise ValueError(f"seeds lists {repeated} more than once: each seed is one cell, one run directory")
        if not 0 < self.stop_timeout_s <= MAX_STOP_TIMEOUT_S:
            raise ValueError(f"stop_timeout_s must be in (0, {MAX_STOP_TIMEOUT_S:g}] seconds, "
                             f"got {self.stop_timeout_s}")
        longest = max(len(f"{loss}__{stress}__s{seed}".encode()) for loss in self.losses for stress in self.stress
                      for seed in self.seeds)
        if longest > MAX_CELL_NAME_BYTES:  # each cell is a run directory and a run name
            raise ValueError(f"a cell name (<loss>__<stress>__s<seed>) is {longest} bytes; at most "
                             f"{MAX_CELL_NAME_BYTES}: shorten the loss or stress names")
        for key in ("summary", "figures"):
            rel = Path(getattr(self, key))
            if rel.is_absolute() or ".." in rel.parts or rel.parts[:1] in ((), ("runs",)):  # () is "" or "."
                raise ValueError(f"{key} must be a path inside out, not under its runs/, got {getattr(self, key)!r}")
        if not self.summary.endswith(".md"):
            raise ValueError(f"summary must name a .md file, got {self.summary!r}")


@dataclass(frozen=True)
class Cell:
    loss: str
    stress: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.loss}__{self.stress}__s{self.seed}"


def load_study(path: str | Path, overrides: list[str] = ()) -> StudyConfig:
    """The study recipe, its ``recipe`` resolved against the file's directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study recipe {path} not found")
    merged = OmegaConf.merge(OmegaConf.load(path), overrides_tree(overrides))
    cfg = build_dataclass(StudyConfig, OmegaConf.to_container(merged, resolve=True), "study")
    cfg.recipe = str((path.resolve().parent / cfg.recipe).resolve())
    return cfg


def cells(cfg: StudyConfig) -> list[Cell]:
    return [Cell(loss, stress, seed) for stress in cfg.stress for loss in cfg.losses for seed in cfg.seeds]


def selected_cells(cfg: StudyConfig, only: "list[str] | tuple[str, ...]" = ()) -> list[Cell]:
    """The grid's cells whose name (``LOSS__STRESS__sSEED``) matches one of the ``only``
    patterns (shell wildcards), or all of them; ConfigError when a pattern matches none."""
    every = cells(cfg)
    if not only:
        return every
    for pattern in only:
        if not any(fnmatch.fnmatchcase(c.name, pattern) for c in every):
            names = ", ".join(c.name for c in every[:4]) + (", ..." if len(every) > 4 else "")
            raise ConfigError(f"--only {pattern!r} matches no cell of the grid ({len(every)} cells: {names})")
    return [c for c in every if any(fnmatch.fnmatchcase(c.name, p) for p in only)]


def cell_overrides(cfg: StudyConfig, cell: Cell, out: Path) -> list[str]:
    data = Path(cfg.data)
    return [
        f"model.path={cfg.start_policy}", "sft.enabled=false",
        f"retrieval.corpus={data / 'corpus.jsonl'}", f"data.train={data / 'train.parquet'}",
        f"data.val={data / 'validation.parquet'}",
        *cfg.losses[cell.loss], *cfg.stress[cell.stress], *cfg.overrides,
        f"schedule.seed={cell.seed}", f"logging.dir={out / 'runs'}", f"logging.run_name={cell.name}",
        "logging.progress=none", "checkpoint.resume=auto",
    ]


def is_done(run_dir: Path, total_steps: int) -> bool:
    try:
        return any(row.get("step") == total_steps for row in read_metrics(run_dir))
    except FileNotFoundError:
        return False


TRAIN_MODULE = "sorl_megatron.train"  # what each cell runs (a test puts a stand-in here)


class _Cells:
    """The cells' processes, so that an interrupted study stops the running ones and starts no more.

    Each cell runs in its own process group: Ctrl-C at the terminal reaches the study alone,
    which hands each running cell exactly one SIGINT (the trainer stops its servers and exits).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = False
        self.running: dict[Cell, subprocess.Popen] = {}

    def stop(self, signum: int, timeout_s: float) -> None:
        with self.lock:
            self.stopping = True
            procs = list(self.running.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_cell(cfg: StudyConfig, cell: Cell, out: Path, procs: Optional[_Cells] = None) -> tuple[Cell, int, str]:
    """One cell in its own process (logs in ``<run>/study.log``); returns its exit code. The
    study holds the cell's run-directory lock while it runs and passes it to the trainer."""
    if procs is not None and procs.stopping:
        return cell, 130, "not started (interrupted)"
    overrides = cell_overrides(cfg, cell, out)
    train_cfg = load_recipe(cfg.recipe, overrides)  # a bad grid entry fails here, naming the key
    run_dir = out / "runs" / cell.name
    problem = run_settings_problem(train_cfg)  # the grid changed under the same cell name
    if problem:
        return cell, 2, f"refused: {problem}"
    if is_done(run_dir, train_cfg.schedule.total_steps):
        return cell, 0, "done before"
    try:
        lock = acquire_run_lock(run_dir, what="out")
    except RunLockError as err:  # another study (or a trainer) is running this cell, or run.lock is unusable
        return cell, 2, f"refused: {err}"
    procs = procs or _Cells()
    print(f"[study] {cell.name}: starting, {rerun_plan(train_cfg)} (log: {run_dir / 'study.log'})", flush=True)
    with lock:
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // cfg.parallel))
        env = dict(os.environ, OMP_NUM_THREADS=threads, **lock.child_env())  # cells side by side share the cores
        cmd = [sys.executable, "-m", TRAIN_MODULE, "--config", cfg.recipe, *overrides]
        with open(run_dir / "study.log", "ab") as log:
            with procs.lock:
                if procs.stopping:
                    return cell, 130, "not started (interrupted)"
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                        pass_fds=(lock.fd,), process_group=0)
                procs.running[cell] = proc
            code = proc.wait()
            with procs.lock:
                procs.running.pop(cell, None)
    return cell, code, "ran" if code == 0 else f"failed (exit {code}; see {run_dir / 'study.log'})"


def run_study(cfg: StudyConfig, parallel: Optional[int] = None,
              only: "list[str] | tuple[str, ...]" = ()) -> list[tuple[Cell, int, str]]:
    """Every cell not done yet (of those ``only`` selects), ``parallel`` at a time; each says when
    it starts and from where (a fresh start, or the step it resumes from). On Ctrl-C (KeyboardInterrupt, or
    SIGTERM as :class:`SignalInterrupt`) the running cells get the same signal and at most
    ``stop_timeout_s`` to exit, no other cell starts, and the interrupt is raised again."""
    out = Path(cfg.out)
    if not Path(cfg.start_policy, "config.json").is_file():
        raise ConfigError(f"study.start_policy: {cfg.start_policy} has no config.json (run `make demo` for the "
                          "demo's SFT policy, or point it at an HF model directory)")
    todo = selected_cells(cfg, only)
    for cell in todo:  # the whole grid before the first cell trains: a typo in the last one fails now
        load_recipe(cfg.recipe, cell_overrides(cfg, cell, out))
    results = []
    procs = _Cells()
    pool = cf.ThreadPoolExecutor(max_workers=parallel or cfg.parallel)
    try:
        futures = [pool.submit(run_cell, cfg, c, out, procs) for c in todo]
        for future in futures:  # in grid order
            cell, code, what = future.result()
            print(f"[study] {cell.name}: {what}", flush=True)
            results.append((cell, code, what))
    except KeyboardInterrupt as err:
        pool.shutdown(wait=False, cancel_futures=True)
        procs.stop(int(getattr(err, "signum", signal.SIGINT)), cfg.stop_timeout_s)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


# ----------------------------------------------------------------------------- summary


# statistic -> (column heading, what it is): docs/study.md's definitions of its results table
SUMMARY_COLUMNS: dict[str, tuple[str, str]] = {
    "final_em": ("final EM", "validation EM at the last step"),
    "best_em": ("best EM after step 0", "the best validation EM after the starting policy's"),
    "em_auc": ("EM area", "mean EM over the run (trapezoids over the validation steps)"),
    "max_kl": ("max KL (k3)", "largest per-step KL(pi_old || pi), k3"),
    "max_grad_norm": ("max grad norm", "largest per-step gradient norm before clipping"),
}


def cell_statistics(rows: list[dict[str, Any]], collapse_fraction: float) -> dict[str, float]:
    """The summary's columns for one run (:data:`SUMMARY_COLUMNS` says what each is, as
    docs/study.md does) and whether it collapsed (see ``StudyConfig``)."""
    em = sorted(metric_series(rows, "val/em").items())
    out: dict[str, float] = {}
    if em:
        steps, values = zip(*em)
        out["final_em"] = values[-1]
        trained = [v for t, v in em if t > 0]  # step 0 is the starting policy, the same for every loss
        if trained:
            out["best_em"] = max(trained)
        span = steps[-1] - steps[0]
        out["em_auc"] = (sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2
                             for i in range(len(em) - 1)) / span) if span else values[0]
        out["collapsed"] = float(collapse_step(rows, collapse_fraction) is not None)
    for key, name in (("actor/approx_kl_k3", "max_kl"), ("actor/grad_norm", "max_grad_norm")):
        series = metric_series(rows, key)
        if series:
            out[name] = max(series.values())
    return out


def summarize(cfg: StudyConfig) -> Path:
    """``<out>/<summary>`` (a table per stress level: mean ± std over seeds) and one figure per
    metric in ``<out>/<figures>``."""
    out = Path(cfg.out)
    runs: dict[Cell, list[dict[str, Any]]] = {}
    for cell in cells(cfg):
        try:
            runs[cell] = read_metrics(out / "runs" / cell.name)
        except FileNotFoundError:
            continue
    lines = [f"# Study summary ({len(runs)} of {len(cells(cfg))} runs found)", "",
             "Mean ± std over seeds of each run's " + "; ".join(f"{name}: {what}" for name, what in
                                                             SUMMARY_COLUMNS.values()) + ". "
             f"Collapsed: runs in which a validation EM fell below {cfg.collapse_fraction:g} x the best EM "
             "reached before it (that best >= 0.05).", ""]
    columns = tuple(SUMMARY_COLUMNS)
    for stress in cfg.stress:
        lines += [f"## stress: {stress} (`{' '.join(cfg.stress[stress])}`)", "",
                  "| loss | seeds | " + " | ".join(name for name, _ in SUMMARY_COLUMNS.values()) + " | collapsed |",
                  "|---|---|" + "---|" * (len(columns) + 1)]
        for loss in cfg.losses:
            mine = [c for c in runs if (c.loss, c.stress) == (loss, stress)]
            stats = [cell_statistics(runs[c], cfg.collapse_fraction) for c in mine]
            if not stats:
                continue
            cells_txt = []
            for col in columns:
                vals = [s[col] for s in stats if col in s]
                cells_txt.append(_mean_std(vals))
            collapsed = sum(int(s.get("collapsed", 0)) for s in stats)
            lines.append(f"| {loss} | {len(stats)} | " + " | ".join(cells_txt) + f" | {collapsed}/{len(stats)} |")
        lines.append("")
    lines += run_table(runs) + [""]
    warnings = [run_warnings(cell.name, rows, cfg.indicators, cfg.collapse_fraction) for cell, rows in runs.items()]
    lines += indicator_report(warnings, cfg.indicators)
    path = out / cfg.summary
    figures = _figures(cfg, runs, out / cfg.figures)
    lines += ["## Figures", ""] + [f"![{p.stem}]({os.path.relpath(p, path.parent)})" for p in figures] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def run_table(runs: dict[Cell, list[dict[str, Any]]]) -> list[str]:
    """Every run seed by seed: its validation EM curve, the train/inference KL (median and max over
    its steps), the peaks of KL(old || new), the clip ratio and the gradient norm, and the range of
    the clip-bias factor (each RL step's mean over its optimizer steps) over the run."""
    lines = ["## Every run", "",
             "| run | validation EM | train/inference KL, median (max) | max KL (k3) | max clip ratio | max grad norm "
             "| mean factor per RL step (min-max) |",
             "|---|---|---|---|---|---|---|"]
    for cell, rows in runs.items():
        em = sorted(metric_series(rows, "val/em").items())
        curve = " / ".join(f"{v:.3f}" for _, v in em) + (f" (steps {', '.join(str(t) for t, _ in em)})" if em else "-")
        mismatch = sorted(metric_series(rows, "mismatch/kl_k3").values())
        columns = [f"{mismatch[(len(mismatch) - 1) // 2]:.2g} ({mismatch[-1]:.2g})" if mismatch else "-"]
        for key in ("actor/approx_kl_k3", "actor/clip_frac", "actor/grad_norm"):
            series = metric_series(rows, key)
            columns.append(f"{max(series.values()):.3g}" if series else "-")
        factor = metric_series(rows, "actor/clip_bias/factor")
        columns.append(f"{min(factor.values()):.2f}-{max(factor.values()):.2f}" if factor else "-")
        lines.append(f"| {cell.loss}, {cell.stress}, {cell.seed} | {curve} | " + " | ".join(columns) + " |")
    return lines


def export_record(cfg: StudyConfig, dest: str | Path) -> list[Path]:
    """The grid's record: each of its runs found under ``<out>/runs``, every row cut to ``step``,
    :data:`RECORD_KEYS`, the figures' and the indicators' metrics (numbers as logged: a summary
    rounds a float32 EM such as 0.83749998 as the run's would), written to
    ``<dest>/runs/<cell>/metrics.jsonl``.
    ``summarize`` reads it as it reads the runs (``out=<dest>``), so a study's tables and figures
    can be committed with the numbers they come from. Returns the files written."""
    out, dest = Path(cfg.out), Path(dest)
    if dest.resolve() == out.resolve():  # the cut record would replace the runs' full metrics
        raise ConfigError(f"--export {dest} is the study's out: export to another directory")
    keep = {"step", *RECORD_KEYS, *FIGURE_METRICS, *(ind.metric for ind in cfg.indicators.values())}
    written = []
    for cell in cells(cfg):
        try:
            rows = read_metrics(out / "runs" / cell.name)
        except FileNotFoundError:
            continue
        cut = [{k: v for k, v in row.items() if k in keep} for row in rows]
        path = dest / "runs" / cell.name / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in cut if len(row) > 1))
        tmp.replace(path)
        written.append(path)
    return written


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return f"{mean:.3g} ± {std:.2g}"


def _figures(cfg: StudyConfig, runs: dict[Cell, list[dict[str, Any]]], fig_dir: Path) -> list[Path]:
    """Per metric: one panel per stress level that has runs, one curve per loss (the mean over its seeds, a
    min-max band where it has more than one), each loss with its own colour, line style and
    marker in every panel; curves identical to another loss's are named in the panel's title,
    the legend sits beside the panels and the symbols are explained under them."""
    import matplotlib  # only summaries pay for it; the file backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    written = []
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    looks = {loss: {"color": palette[i % len(palette)], **line_style(i)} for i, loss in enumerate(cfg.losses)}
    stresses = [s for s in cfg.stress if any(c.stress == s for c in runs)]  # a level no run reached has no panel
    for key, title in FIGURE_METRICS.items():
        if not stresses:
            break
        fig, axes = plt.subplots(1, len(stresses), figsize=(5 * len(stresses), 3.6), squeeze=False)
        legend: dict[str, Any] = {}
        seeds: set[int] = set()
        for ax, stress in zip(axes[0], stresses):
            drawn: list[float] = []
            curves = []
            for loss in cfg.losses:
                series = [metric_series(runs[c], key) for c in runs if (c.loss, c.stress) == (loss, stress)]
                series = [s for s in series if s]
                steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
                if not steps:
                    continue
                values = [[s[t] for s in series] for t in steps]
                mean = [sum(v) / len(v) for v in values]
                legend.setdefault(loss, ax.plot(steps, mean, markersize=4, label=f"{loss} (n={len(series)})",
                                                **looks[loss])[0])
                if len(series) > 1:
                    low, high = [min(v) for v in values], [max(v) for v in values]
                    ax.fill_between(steps, low, high, color=looks[loss]["color"], alpha=0.15)
                    drawn += low + high
                drawn += mean
                seeds.add(len(series))
                curves.append((loss, steps, mean))
            same = identical_note(identical_curves(curves))
            ax.set_title(f"stress: {stress}" + (f"\n{same}" if same else ""), fontsize=10 if not same else 8)
            style_axis(ax, key, drawn, ylabel=None if key in METRIC_AXES else title,
                       steps=[t for _, xs, _ in curves for t in xs])
            ax.grid(alpha=0.3)
        if legend:
            what = ("mean over seeds (n per loss in the legend), shaded band: min-max over seeds" if max(seeds) > 1
                    else "one seed per loss, no band")
            fig.suptitle(f"{title}: {what}", fontsize=10)
            fig.tight_layout()
            # every loss drawn in any panel, with its seed count (per cell in summary.md), beside the panels
            fig.legend(handles=list(legend.values()), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 0.9))
            notes = symbol_notes([key])
            if notes:
                fig.text(0.01, 0.0, notes, fontsize=7, va="top", ha="left")
            path = fig_dir / f"{key.replace('/', '_')}.png"
            fig.savefig(path, dpi=80, bbox_inches="tight")
            written.append(path)
        plt.close(fig)
    return written


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler, ``kill``) stops the study as Ctrl-C does (main thread only)."""

    def interrupt(signum, frame):
        raise SignalInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sorl_megatron.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="study recipe (YAML)")
    parser.add_argument("--parallel", type=count(1, MAX_PARALLEL), default=None,
                        help="cells at once (default: the recipe's)")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the summary and the figures")
    parser.add_argument("--export", metavar="DIR", default=None,
                        help="only write the grid's record (its runs' metrics cut to what the summary reads) to "
                             "DIR/runs; summarize it with --summarize out=DIR")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only the cells whose name LOSS__STRESS__sSEED matches (shell wildcards, "
                             "repeatable), e.g. --only 'grpo__*__s1': a small subset of the grid")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the study recipe, e.g. seeds=[1]")
    args = parser.parse_args(argv)
    try:
        cfg = load_study(args.config, args.overrides)
        if args.export is not None:
            written = export_record(cfg, args.export)
            where = Path(args.export) / "runs"
            print(f"[study] record: {len(written)} of {len(cells(cfg))} runs written under {where}")
            return 0
        with sigterm_as_interrupt():
            results = [] if args.summarize else run_study(cfg, args.parallel, args.only)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # one line, as train's, instead of a traceback
        signum = int(getattr(err, "signum", signal.SIGINT))
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"[study] interrupted ({what}): stopped the running cells and their servers; run the same command "
              "again to continue (finished cells are skipped, interrupted ones resume from their last checkpoint)",
              file=sys.stderr, flush=True)
        return 128 + signum
    path = summarize(cfg)
    print(f"[study] summary: {path}")
    return 1 if any(code for _, code, _ in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
