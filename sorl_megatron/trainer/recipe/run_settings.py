"""What a run directory is a run *of*, and the command that continues it.

A run directory (``<logging.dir>/<logging.run_name>``) holds one run: its checkpoints, metrics
and the ``config.yaml`` the trainer writes when the run starts. :func:`run_settings_problem`
compares the recipe of a new invocation with that file on the settings that define the run
(:data:`DEFINING_KEYS`): a different loss, estimator, model, data, corpus or batch geometry
under the same name would resume, or overwrite, another experiment's checkpoints and curves, so
it is refused, naming each difference and a run name to use instead. Everything else (the
number of steps, logging, timeouts) may change between invocations: a resumed run with more
``schedule.total_steps`` is the same run.

The checkpoint directory (``checkpoint.dir``, which may lie outside the run directory) belongs
to one run too: the trainer writes :data:`CHECKPOINT_SETTINGS` there when a run starts (its run
directory and defining settings) and every RL checkpoint carries the defining settings in its
``trainer.json``. A run whose checkpoint directory holds another run's checkpoints (another run
directory, other defining settings) is refused, whether or not ``config.yaml`` is still there.

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
    "retrieval.corpus": "corpus-{}",
}
PATH_KEYS = ("model.path", "data.train", "data.val", "retrieval.corpus")
CHECKPOINT_SETTINGS = "run_settings.json"  # in checkpoint.dir: whose checkpoints these are
SETTINGS_ENTRY = "run_settings"  # in each RL checkpoint's trainer.json (extra): the defining settings
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


def _changes(old: Any, cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The defining settings that differ between ``old`` (a recipe tree, or a flat dict of
    dotted keys) and ``cfg``; a key ``old`` does not have is not compared."""
    now = defining_settings(cfg)
    get = (lambda key: old.get(key, _MISSING)) if isinstance(old, dict) and any("." in k for k in old) \
        else (lambda key: _get(old, key))
    return {key: (get(key), value) for key, value in now.items()
            if get(key) is not _MISSING and not _same(key, get(key), value)}


def _listed(changed: dict[str, tuple[Any, Any]]) -> str:
    return "\n".join(f"  {key}: {old!r} there, {new!r} now" for key, (old, new) in changed.items())


def _new_name(cfg: TrainConfig, changed: dict[str, tuple[Any, Any]]) -> str:
    """A run name for these settings that still fits a file name (255 bytes)."""
    name = f"{cfg.logging.run_name}_{settings_suffix({k: new for k, (_, new) in changed.items()})}"
    return name.encode()[:255].decode(errors="ignore")


def run_settings_problem(cfg: TrainConfig) -> Optional[str]:
    """Why ``cfg`` may not run in its run directory (whose ``config.yaml`` has other defining
    settings) or write into its ``checkpoint.dir`` (another run's checkpoints, or checkpoints
    made with other defining settings), or None; the callers raise their own error with it."""
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    saved = run_dir / "config.yaml"
    if saved.is_file():
        from omegaconf import OmegaConf

        try:
            old = OmegaConf.to_container(OmegaConf.load(saved))
        except Exception as err:  # a damaged or hand-edited file
            return f"{saved}: cannot be read as the run's recipe ({err}); remove it or the run directory to start over"
        changed = _changes(old, cfg)
        if changed:
            return (
                f"logging.run_name={cfg.logging.run_name}: the run directory {run_dir} holds a run with other "
                f"settings ({saved}):\n{_listed(changed)}\nA run directory holds one run (its checkpoints would be "
                f"resumed with these settings): to run them, name a new run, e.g. "
                f"logging.run_name={_new_name(cfg, changed)}; to start over, remove {run_dir}"
            )
    return checkpoint_dir_problem(cfg)


def checkpoint_dir_problem(cfg: TrainConfig) -> Optional[str]:
    """Why ``cfg`` may not use its ``checkpoint.dir``: it holds the checkpoints of another run
    directory (:data:`CHECKPOINT_SETTINGS`), or checkpoints made with other defining settings
    (that file, or the newest checkpoint's own ``trainer.json`` when the file is gone); None if
    it may."""
    import json

    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    ckpt = Path(cfg.checkpoint.dir)
    record_path = ckpt / CHECKPOINT_SETTINGS
    where = (f"checkpoint.dir={ckpt}: it holds the checkpoints of another run, which this run would resume as its "
             "own and write into")
    fix = ("give this run its own checkpoint.dir (unset: <logging.dir>/<logging.run_name>/checkpoints), or remove "
           f"{ckpt} to start over")
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            owner, settings = str(record["run_dir"]), dict(record["settings"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"{record_path}: cannot be read ({type(err).__name__}: {err}); {fix}"
        if os.path.abspath(owner) != os.path.abspath(run_dir):
            return f"{where} (the run directory {owner}, {record_path}); this run's is {run_dir}: {fix}"
        changed = _changes(settings, cfg)
        if changed:
            return f"{where} ({record_path}), made with other settings:\n{_listed(changed)}\n{fix}"
    if cfg.checkpoint.resume != "auto":
        return None  # checkpoint.resume names the checkpoint to start from on purpose
    from ...engine.checkpoint import CheckpointFileError, complete_checkpoints, read_checkpoint_meta

    done = complete_checkpoints(ckpt) if ckpt.is_dir() else []
    if not done:
        return None
    try:
        _, _, extra = read_checkpoint_meta(done[-1])
    except CheckpointFileError:
        return None  # the resume names it (a damaged checkpoint is skipped or refused there)
    settings = extra.get(SETTINGS_ENTRY)
    changed = _changes(settings, cfg) if isinstance(settings, dict) else {}
    if changed:
        return f"{where} ({done[-1]}/trainer.json), made with other settings:\n{_listed(changed)}\n{fix}"
    return None


def checkpoint_dir_record(cfg: TrainConfig) -> str:
    """What :data:`CHECKPOINT_SETTINGS` holds: the run directory and its defining settings."""
    import json

    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    return json.dumps({"run_dir": os.path.abspath(run_dir), "settings": defining_settings(cfg)}, indent=1) + "\n"


def write_checkpoint_dir_record(cfg: TrainConfig) -> None:
    """Rank 0, when a run starts: mark ``checkpoint.dir`` as this run's (atomic replace)."""
    ckpt = Path(cfg.checkpoint.dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / f".{CHECKPOINT_SETTINGS}.tmp"
    tmp.write_text(checkpoint_dir_record(cfg))
    os.replace(tmp, ckpt / CHECKPOINT_SETTINGS)


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
