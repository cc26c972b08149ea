"""The CPU demo, end to end: what `make demo` runs.

    python tools/demo.py [--recipe recipes/tiny_search_so_grpo.yaml] [key=value ...]

1. Generates the synthetic search data set, an offline BPE tokenizer and a tiny random
   Qwen3-MoE model (hidden 128, tied embeddings) into runs/tiny/ (skipped when present; no
   downloads).
2. Trains with the recipe: SFT cold start on gold trajectories, then RL (SO-GRPO by default)
   with the embedded rollout and BM25 retrieval servers on 127.0.0.1, validation EM every
   few steps and checkpoints (re-running resumes; `rm -rf runs/` starts over). Overrides that
   change what the run is (loss, estimator, model, data, batch geometry, seed) go into the
   run's name (``so_grpo_so_ppo`` for ``algorithm.loss.name=so_ppo``), so a variant never
   resumes the demo's own run; ``make demo ARGS="..."`` passes them.
3. Writes PNG curves to <run dir>/plots/ and prints validation EM after SFT and after RL.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def elsewhere_note(data: Path) -> str:
    """A line for a demo started outside the repository whose relative data directory is missing
    here but present in the repository: it would build a second data set and start a new SFT,
    which is what the user asked for only if they meant to ("" otherwise)."""
    if data.is_absolute() or Path.cwd().resolve() == ROOT or not (ROOT / data / "model" / "config.json").is_file():
        return ""
    return (f"[demo] note: {data}/ is relative to the working directory {Path.cwd()}, not to the repository, whose "
            f"{data}/ already holds the demo's data; this run builds new data and its own SFT here (Ctrl-C, then "
            f"run it from {ROOT} to continue the demo there)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny_search_so_grpo.yaml"),
                        help="recipe to train (default recipes/tiny_search_so_grpo.yaml)")
    parser.add_argument("--data", default="runs/tiny", help="where the synthetic data and model go (default runs/tiny)")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. schedule.total_steps=4")
    args = parser.parse_args(argv)
    try:
        from sorl_megatron.common.environment import require_environment
    except ModuleNotFoundError:  # this python has not got the project installed: not its environment
        print(f"tools/demo.py: sorl_megatron cannot be imported by {sys.executable}, which is not the project's "
              "virtual environment; run: source .venv/bin/activate (or make setup)", file=sys.stderr)
        return 2
    require_environment("tools/demo.py")  # before the heavy imports

    from sorl_megatron.common.run_lock import RunLockedError, RunLockError, acquire_run_lock
    from sorl_megatron.data.synthetic import main as make_data
    from sorl_megatron.trainer.metrics.logger import read_metrics, show_trainer_log
    from sorl_megatron.trainer.metrics.plots import plot_runs
    from sorl_megatron.trainer.recipe.config import RecipeError
    from sorl_megatron.trainer.recipe.inputs import InputError
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.rl_loop import RLTrainer

    data = Path(args.data)
    if not (data / "model" / "config.json").is_file():
        if note := elsewhere_note(data):
            print(note, flush=True)
        print(f"[demo] generating the synthetic data set, tokenizer and tiny MoE model in {data.resolve()}/",
              flush=True)
        make_data(["--out", str(data), "--make-model", "--hidden-size", "128", "--tie-embeddings"])
    own = [f"model.path={data}/model", f"retrieval.corpus={data}/corpus.jsonl",
           f"data.train={data}/train.parquet", f"data.val={data}/validation.parquet"]
    try:
        cfg = load_recipe(args.recipe, own + args.overrides)
        name = run_name(cfg, load_recipe(args.recipe, own), args.overrides)
        if name != cfg.logging.run_name:
            print(f"[demo] your overrides change what the run is: it is run {name}, not {cfg.logging.run_name} "
                  "(set logging.run_name= to name it yourself)", flush=True)
            cfg = load_recipe(args.recipe, own + args.overrides + [f"logging.run_name={name}"])
    except RecipeError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    print(f"[demo] training {cfg.algorithm.loss.name} ({args.recipe}); metrics in {run_dir}/metrics.jsonl", flush=True)
    show_trainer_log()
    try:
        with acquire_run_lock(run_dir):
            RLTrainer(cfg).run()
            written = plot_runs([run_dir], run_dir / "plots")
    except RunLockedError as err:
        print(f"run directory in use: {err}", file=sys.stderr)
        return 2
    except RunLockError as err:  # not a directory, a link or a FIFO at run.lock: left as it is
        print(f"run directory error: {err}", file=sys.stderr)
        return 2
    except InputError as err:
        print(f"input error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C: the trainer stopped its servers; one line, no traceback
        from sorl_megatron.trainer.serving.servers import report_interrupt

        return report_interrupt(err)
    rows = [r for r in read_metrics(run_dir) if r.get("val/em") is not None]
    if rows:
        first, last = rows[0], rows[-1]
        best = max(rows, key=lambda r: r["val/em"])
        print(f"[demo] validation EM after SFT (step 0): {first['val/em']:.3f}; after RL (step {last['step']}): "
              f"{last['val/em']:.3f}; best {best['val/em']:.3f} at step {best['step']}")
    print(f"[demo] plots: {run_dir / 'plots'} ({len(written)} PNG files, summary.png has them all)")
    return 0


def run_name(cfg, default, overrides: list[str]) -> str:
    """The demo's run name for ``cfg``: the recipe's, with the defining settings (see
    trainer/recipe/run_settings.py) that the command-line overrides change from the demo's ``default``
    appended (``so_grpo_so_ppo_seed2``), so that a variant never resumes the demo's own run;
    an explicit ``logging.run_name=`` is kept as given."""
    from sorl_megatron.trainer.recipe.run_settings import defining_settings, settings_suffix

    if any(o.split("=", 1)[0].lstrip("+") == "logging.run_name" for o in overrides):
        return cfg.logging.run_name
    mine, demo = defining_settings(cfg), defining_settings(default)
    changed = {key: value for key, value in mine.items() if value != demo[key]}
    return f"{cfg.logging.run_name}_{settings_suffix(changed)}" if changed else cfg.logging.run_name


if __name__ == "__main__":
    raise SystemExit(main())
