"""The CPU demo, end to end: what `make demo` runs.

    python tools/demo.py [--recipe recipes/tiny_search_so_grpo.yaml] [key=value ...]

1. Generates the synthetic search data set, an offline BPE tokenizer and a tiny random
   Qwen3-MoE model (hidden 128, tied embeddings) into runs/tiny/ (skipped when present; no
   downloads).
2. Trains with the recipe: SFT cold start on gold trajectories, then RL (SO-GRPO by default)
   with the embedded rollout and BM25 retrieval servers on 127.0.0.1, validation EM every
   few steps and checkpoints (re-running resumes; `rm -rf runs/` starts over).
3. Writes PNG curves to <run dir>/plots/ and prints validation EM after SFT and after RL.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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

    from sorl_megatron.data.synthetic import main as make_data
    from sorl_megatron.trainer.config import ConfigError, load_recipe
    from sorl_megatron.trainer.metrics_log import read_metrics, show_trainer_log
    from sorl_megatron.trainer.plots import plot_runs
    from sorl_megatron.trainer.rl_loop import RLTrainer

    data = Path(args.data)
    if not (data / "model" / "config.json").is_file():
        print(f"[demo] generating the synthetic data set, tokenizer and tiny MoE model in {data}/", flush=True)
        make_data(["--out", str(data), "--make-model", "--hidden-size", "128", "--tie-embeddings"])
    overrides = [f"model.path={data}/model", f"retrieval.corpus={data}/corpus.jsonl",
                 f"data.train={data}/train.parquet", f"data.val={data}/validation.parquet", *args.overrides]
    try:
        cfg = load_recipe(args.recipe, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    print(f"[demo] training {cfg.algorithm.loss.name} ({args.recipe}); metrics in {run_dir}/metrics.jsonl", flush=True)
    show_trainer_log()
    try:
        RLTrainer(cfg).run()
    except KeyboardInterrupt as err:  # Ctrl-C: the trainer stopped its servers; one line, no traceback
        from sorl_megatron.trainer.servers import report_interrupt

        return report_interrupt(err)
    written = plot_runs([run_dir], run_dir / "plots")
    rows = [r for r in read_metrics(run_dir) if r.get("val/em") is not None]
    if rows:
        first, last = rows[0], rows[-1]
        best = max(rows, key=lambda r: r["val/em"])
        print(f"[demo] validation EM after SFT (step 0): {first['val/em']:.3f}; after RL (step {last['step']}): "
              f"{last['val/em']:.3f}; best {best['val/em']:.3f} at step {best['step']}")
    print(f"[demo] plots: {run_dir / 'plots'} ({len(written)} PNG files, summary.png has them all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
