"""What a run directory is a run *of*, and the command that continues it.

A run directory (``<logging.dir>/<logging.run_name>``) holds one run: its checkpoints, metrics
and the ``config.yaml`` the trainer writes when the run starts. :func:`run_settings_problem`
compares the recipe of a new invocation with that file on the settings that define the run
(:data:`DEFINING_KEYS`): a different loss, estimator, model, data or batch geometry under the
same name would resume, or overwrite, another experiment's checkpoints and curves, so it is
refused, naming each difference and a run name to use instead. Everything else (the number of
steps, logging, timeouts) may change between invocations: a resumed run with more
``schedule.total_steps`` is the same run.

:func:`rerun_command` writes the command line that ran this process with some overrides
changed, as the user typed it (``python -m sorl_megatron.train ...``, ``python tools/demo.py
...``, or ``make demo ARGS="..."`` when the Makefile says so through ``$SORL_MEGATRON_RERUN``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ...common.typed_config import to_dict
from .config import TrainConfig

# key -> how a run name shows its value (see settings_suffix)
DEFINING_KEYS: dict[str, str] = {
    "algorithm.loss.name": "{}",
    "algorithm.advantage.estimator": "{}",
    "model.path": "model-{}",
    "data.train": "train-{}",
    "data.val": "val-{}",
    "schedule.batch_size": "bs{}",
    "rollout.group_size": "g{}",
    "schedule.mini_batch_size": "mb{}",
    "schedule.ppo_epochs": "ep{}",
    "schedule.seed": "seed{}",
}
PATH_KEYS = ("model.path", "data.train", "data.val")
RERUN_ENV = "SORL_MEGATRON_RERUN"  # a command template with {} for the arguments (the Makefile's demo target)
_MISSING = object()


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _same(key: str, old: Any, new: Any) -> bool:
    if old == new:
        return True
    if key in PATH_KEYS and old and new:  # the same file written relative or absolute
        return os.path.abspath(str(old)) == os.path.abspath(str(new))
    return False


def defining_settings(cfg: TrainConfig | dict) -> dict[str, Any]:
    tree = cfg if isinstance(cfg, dict) else to_dict(cfg)
    return {key: _get(tree, key) for key in DEFINING_KEYS}


def settings_suffix(settings: dict[str, Any]) -> str:
    """A run-name suffix for these settings: ``so_ppo_seed2``, ``model-sft_model_bs4``."""
    parts = []
    for key, value in settings.items():
        if key in PATH_KEYS and value:
            value = Path(str(value)).stem or Path(str(value)).name
        parts.append(DEFINING_KEYS[key].format(value))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts))


def run_settings_problem(cfg: TrainConfig) -> Optional[str]:
    """Why ``cfg`` may not run in its run directory (whose ``config.yaml`` has other defining
    settings), or None; the callers raise their own error with it."""
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        old = OmegaConf.to_container(OmegaConf.load(saved))
    except Exception as err:  # a damaged or hand-edited file
        return f"{saved}: cannot be read as the run's recipe ({err}); remove it or the run directory to start over"
    now = defining_settings(cfg)
    changed = {key: (_get(old, key), value) for key, value in now.items()
               if _get(old, key) is not _MISSING and not _same(key, _get(old, key), value)}
    if not changed:
        return None
    lines = "\n".join(f"  {key}: {old_value!r} there, {new_value!r} now" for key, (old_value, new_value)
                      in changed.items())
    name = f"{cfg.logging.run_name}_{settings_suffix({k: new for k, (_, new) in changed.items()})}"
    return (
        f"logging.run_name={cfg.logging.run_name}: the run directory {run_dir} holds a run with other settings "
        f"({saved}):\n{lines}\nA run directory holds one run (its checkpoints would be resumed with these "
        f"settings): to run them, name a new run, e.g. logging.run_name={name}; to start over, remove {run_dir}"
    )


def _with_overrides(args: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``args`` with each ``key=value`` of ``extra`` replacing the same key (or appended)."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [a for a in args if a.split("=", 1)[0].lstrip("+") not in keys] + list(extra)


def rerun_command(*extra: str, argv: Optional[Sequence[str]] = None) -> Optional[str]:
    """The command that ran this process, with the overrides ``extra`` set; None when it cannot
    be written: a process started by torchrun (whose options it does not see), or one that is
    not an entry point of this repository (a test, a notebook)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return None
    args = _with_overrides(argv[1:], extra)
    template = os.environ.get(RERUN_ENV)
    if template and "{}" in template:
        return template.replace("{}", shlex.join(args))
    script = Path(argv[0])
    package = Path(__file__).resolve().parents[2]  # sorl_megatron/trainer/recipe/ -> sorl_megatron
    try:
        module = script.resolve().relative_to(package.parent).with_suffix("")
    except (OSError, ValueError):
        return None
    if module.parts[0] == package.name:
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's own options are not in this process's argv
            return None
        prefix = ["python", "-m", ".".join(module.parts)]
    elif module.parts[0] == "tools":
        prefix = ["python", str(argv[0])]
    else:
        return None
    return shlex.join(prefix + args)
