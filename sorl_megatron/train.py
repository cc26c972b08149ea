"""Train an agent with RL on Megatron: ``python -m sorl_megatron.train --config RECIPE [key=value ...]``.

The same command runs under ``torchrun --nnodes N --nproc_per_node G -m sorl_megatron.train
--config ...`` (torchrun's standard rendezvous). The recipe, then its input files (data rows,
retrieval corpus, resume directory), are validated before any process group, server or run
directory exists; overrides are dotted keys (``algorithm.loss.name=so_ppo``). One process at a
time writes a run directory (a lock in it, ``run.lock``), and a run directory made with other
defining settings (loss, estimator, model, data, batch geometry, seed) is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from .common import interrupts
from .common.run_lock import RunLockedError, RunLockError, acquire_run_lock
from .common.typed_config import ConfigError
from .trainer.recipe.config import CONFIG_GROUPS
from .trainer.recipe.inputs import InputError
from .trainer.recipe.launch_checks import validate_layout_for_launch, validate_model_for_plan
from .trainer.recipe.loader import dump_config, load_recipe
from .trainer.recipe.memory_plan import check_memory_for_launch, model_config_for, plan_memory


def build_parser() -> argparse.ArgumentParser:
    groups = "\n".join(f"  {name:<12} {text}" for name, text in CONFIG_GROUPS.items())
    parser = argparse.ArgumentParser(
        prog="python -m sorl_megatron.train",
        description=__doc__,
        epilog=f"config groups (see recipes/ and docs/how-to/write-a-recipe.md):\n{groups}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="recipe YAML (NeMo style, with optional defaults: list)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config after the schema checks and exit (no WORLD_SIZE or model files needed)",
    )
    parser.add_argument(
        "--print-memory",
        action="store_true",
        help="print the per-GPU memory estimate at the recipe's layout and exit (1 when it exceeds the GPU's "
        "memory, or parallelism.gpu_memory_gib); reads model.path's config.json, else model.config_for_planning",
    )
    parser.add_argument(
        "--print-sync-plan",
        action="store_true",
        help="print the weight sync at the recipe's full size, layout and planned world (groups, and per sending "
        "rank its tensors, buckets and bytes; built on the meta device, nothing allocated) and exit",
    )
    parser.add_argument("--model-config", help="an HF config.json (file or directory) for --print-memory")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. schedule.total_steps=5")
    return parser


def env_int(name: str, default: Optional[int] = None, minimum: int = 0) -> Optional[int]:
    """``$name`` as an integer >= ``minimum`` (torchrun sets WORLD_SIZE, RANK ...); ConfigError
    naming it otherwise; ``default`` when it is not set."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"${name}={text!r} must be an integer >= {minimum} (torchrun sets it; unset it to run "
                          "one process)")
    return value


def _print_memory(cfg, model_config: str | None) -> int:
    """The memory plan as a report (a GPU run's estimate, whatever this machine has)."""
    c, critic, source = model_config_for(cfg, model_config)
    validate_model_for_plan(cfg, c, source)  # tp=3 on 28 heads: the layout error, not a plan
    if critic is not None:
        validate_model_for_plan(cfg, critic, f"model.critic_path={cfg.model.critic_path}")
    world = env_int("WORLD_SIZE", minimum=1)
    plan = plan_memory(cfg, c, critic, world, on_gpu=True)
    print(f"{plan.report()}\n  (model config: {source})")
    return 0 if plan.fits else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with interrupts.catching():  # Ctrl-C and SIGTERM raise, once (common/interrupts.py)
        try:
            return _run(args)
        except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the trainer's exit stack stopped the servers
            from .trainer.serving.servers import report_interrupt

            return report_interrupt(err)


def _run(args: argparse.Namespace) -> int:
    try:
        env_int("WORLD_SIZE", minimum=1)  # a bad one is one line here, not a traceback later
        env_int("RANK")
        cfg = load_recipe(args.config, args.overrides)
        if args.print_config:
            # the schema only: the layout checks need the world size and model.path's config.json
            print(dump_config(cfg))
            return 0
        if args.print_memory:
            return _print_memory(cfg, args.model_config)
        if args.print_sync_plan:
            from .trainer.recipe.sync_plan import plan_configs
            from .weight_sync.plan import summary

            print(summary(plan_configs([cfg])[0]))
            return 0
        world_size = env_int("WORLD_SIZE", 1, minimum=1)
        validate_layout_for_launch(cfg, world_size)
        # a GPU run whose estimate exceeds parallelism.gpu_memory_gib stops here (CPU runs: no check)
        import torch

        check_memory_for_launch(cfg, world_size, on_gpu=torch.cuda.is_available())
    except (ConfigError, FileNotFoundError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    # the engines, transformers and the clients load only once the recipe is known to be good
    from .trainer.checkpoints import CheckpointWriteError
    from .trainer.metrics.logger import show_trainer_log
    from .trainer.rl_loop import RLTrainer

    show_trainer_log()
    try:
        # rank 0 alone writes the run directory: one writer per directory (a second run is refused)
        with ExitStack() as stack:
            if int(os.environ.get("RANK", "0")) == 0:
                stack.enter_context(acquire_run_lock(Path(cfg.logging.dir) / cfg.logging.run_name))
                # checkpoint.dir may lie elsewhere (or in another run's directory): one writer there too
                stack.enter_context(acquire_run_lock(cfg.checkpoint.dir, what="checkpoint.dir",
                                                     kind="checkpoint directory"))
            metrics = RLTrainer(cfg).run()  # checks the input files first (data rows, corpus, resume directory)
    except RunLockedError as err:
        print(f"run directory in use: {err}", file=sys.stderr)
        return 2
    except RunLockError as err:  # not a directory, a link or a FIFO at run.lock: left as it is
        print(f"run directory error: {err}", file=sys.stderr)
        return 2
    except InputError as err:
        print(f"input error: {err}", file=sys.stderr)
        return 2
    except CheckpointWriteError as err:  # a full disk: one line naming the directory (earlier checkpoints intact)
        print(f"checkpoint error: {err.strerror}", file=sys.stderr)
        return 1
    if metrics and int(os.environ.get("RANK", "0")) == 0:
        shown = {k: round(v, 4) for k, v in metrics.items() if k in ("rollout/reward", "val/em")}
        print(f"done: {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
