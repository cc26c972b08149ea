"""Plot training curves of one or several runs.

    python tools/plot.py RUN_DIR [RUN_DIR ...] --out plots/ [--labels a,b] [--smooth 0.6] [--overwrite]

Each RUN_DIR holds the metrics.jsonl a training run writes (logging.dir / logging.run_name),
and sft/metrics.jsonl when the run had an SFT stage. Writes one PNG per logged metric (reward,
validation EM, clipping ratio, KL, gradient norm, clip-bias norm, train/inference mismatch, the
SFT loss, ...) and summary.png with all of them, runs overlaid (line style and marker per run,
identical curves named, legend beside the panels), titled with the run names (and for one run
its recipe). Axes: whole steps (a tick on each validation step); y labelled, scores on [0, 1],
other metrics scaled to their data (log when spread over two decades); the symbols explained
under each figure (docs/how-to/write-a-recipe.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _earlier_plots(out: str) -> list[str]:
    """The PNG files already in ``out`` (sorted names; none when it does not exist)."""
    path = Path(out)
    return sorted(p.name for p in path.glob("*.png")) if path.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    try:
        from sorl_megatron.common.cli_range import Range
        from sorl_megatron.common.environment import require_environment
    except ModuleNotFoundError:  # this python has not got the project installed: not its environment
        print(f"tools/plot.py: sorl_megatron cannot be imported by {sys.executable}, which is not the project's "
              "virtual environment; run: source .venv/bin/activate (or make setup)", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", required=True, help="output directory for the PNGs")
    parser.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the PNGs an earlier plot left in --out (without it, such an --out is refused)")
    parser.add_argument("--smooth", type=Range(float, 0.0, 0.999), default=0.0,
                        help="EMA smoothing weight in [0, 1) as TensorBoard's slider (default 0: raw curves); "
                        "the raw curve stays drawn faintly")
    args = parser.parse_args(argv)
    if (earlier := _earlier_plots(args.out)) and not args.overwrite:
        print(f"error: --out {args.out} already holds {len(earlier)} PNG file(s) of an earlier plot "
              f"({earlier[0]}, ...); pass --overwrite to replace them, or give another --out", file=sys.stderr)
        return 2
    require_environment("tools/plot.py")  # before the heavy imports
    from sorl_megatron.trainer.metrics.plots import plot_runs

    try:
        paths = plot_runs(args.runs, args.out, labels=args.labels.split(",") if args.labels else None,
                          smooth=args.smooth)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
