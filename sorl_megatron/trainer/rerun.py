"""Where the same command picks a run up again, and what an interrupted run says about it.

A run has two resumable stages: the SFT cold start (checkpoints ``<checkpoint.dir>/sft/step_K``
every ``sft.save_every`` steps, then ``<run dir>/sft_model`` with its ``SFT_DONE`` marker) and
RL (``<checkpoint.dir>/step_K``). After Ctrl-C or SIGTERM the line the trainer prints is read
from the disk at that moment (complete checkpoints only: a save cut short is not counted), so
it says what a rerun will do whichever phase was interrupted.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

from ..engine.checkpoint import complete_checkpoints
from .recipe.config import TrainConfig

SFT_DONE = "SFT_DONE"  # in the HF directory SFT writes, last: the stage finished


def sft_model_dir(cfg: TrainConfig) -> Path:
    """The finished SFT policy RL starts from (HF files; complete once ``SFT_DONE`` is there)."""
    return Path(cfg.logging.dir) / cfg.logging.run_name / "sft_model"


def sft_finished(cfg: TrainConfig) -> bool:
    return (sft_model_dir(cfg) / SFT_DONE).is_file()


def sft_checkpoint_root(cfg: TrainConfig) -> Path:
    """SFT's resumable checkpoints, beside RL's (which are only the ``step_K`` directly under
    ``checkpoint.dir``); removed once the SFT policy is written."""
    return Path(cfg.checkpoint.dir) / "sft"


def _newest_step(root: Path) -> Optional[int]:
    done = complete_checkpoints(root)
    return int(done[-1].name.split("_", 1)[1]) if done else None


def set_aside_previous_run(cfg: TrainConfig) -> Optional[Path]:
    """``checkpoint.resume=none`` starts RL, and an unfinished SFT, over: what the previous run
    wrote there (its metrics, TensorBoard events, plots, RL checkpoints, and SFT's checkpoints
    when SFT had not finished) moves to ``<run dir>/previous/<k>/``, and the checkpoints to
    ``<checkpoint.dir>/previous/<k>/`` (renames on the same file system, nothing copied), so a
    start-over never overwrites a run. A finished SFT policy (``sft_model``) stays: RL starts
    from it again. Returns the run directory's ``previous/<k>``, None when nothing was there."""
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    ckpt = Path(cfg.checkpoint.dir)
    in_run = [run_dir / name for name in ("metrics.jsonl", "tensorboard", "plots")]
    in_ckpt = sorted(ckpt.glob("step_*")) if ckpt.is_dir() else []
    if cfg.sft.enabled and not sft_finished(cfg):
        in_ckpt.append(sft_checkpoint_root(cfg))
    in_run = [p for p in in_run if p.exists()]
    in_ckpt = [p for p in in_ckpt if p.exists()]
    if not in_run and not in_ckpt:
        return None
    k = 1
    while (run_dir / "previous" / str(k)).exists() or (ckpt / "previous" / str(k)).exists():
        k += 1
    for items, root in ((in_run, run_dir), (in_ckpt, ckpt)):
        if items:
            dest = root / "previous" / str(k)
            dest.mkdir(parents=True)
            for path in items:
                path.rename(dest / path.name)
    return run_dir / "previous" / str(k)


def rerun_plan(cfg: TrainConfig) -> str:
    """What running the same command again does, from what is on disk now ("SFT resumes from
    step 400 of 1000, then RL", "RL starts from step 0 ...", ...)."""
    resume = cfg.checkpoint.resume
    if cfg.sft.enabled and not sft_finished(cfg):
        step = None if resume == "none" else _newest_step(sft_checkpoint_root(cfg))
        if step is not None:
            return f"SFT resumes from step {step} of {cfg.sft.steps}, then RL"
        if resume == "none":
            why = "checkpoint.resume=none"
        elif cfg.sft.save_every:
            why = f"no SFT checkpoint yet, the first is at step {cfg.sft.save_every}"
        else:
            why = "sft.save_every=0 keeps no SFT checkpoint"
        return f"SFT restarts from step 0 ({why}), then RL"
    kept = " with the finished SFT policy (sft_model)" if cfg.sft.enabled else ""
    if resume == "none":
        return f"RL starts over from step 0{kept} (checkpoint.resume=none)"
    if resume != "auto":
        return f"RL resumes from {resume} again (checkpoint.resume)"
    step = _newest_step(Path(cfg.checkpoint.dir))
    if step is None:
        return f"RL starts from step 0{kept} (no RL checkpoint yet)"
    if step >= cfg.schedule.total_steps:
        return f"nothing left to do, the run is finished (its RL checkpoint is at step {step})"
    return f"RL resumes from step {step} of {cfg.schedule.total_steps}"


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM as the trainer saw it: the phase it stopped in and what a rerun does.
    Still a KeyboardInterrupt, so every cleanup on the way out runs as for Ctrl-C."""

    def __init__(self, signum: int, phase: str, plan: str):
        super().__init__(f"signal {signum} during {phase}")
        self.signum, self.phase, self.plan = signum, phase, plan


def interrupted(err: KeyboardInterrupt, phase: str, cfg: TrainConfig) -> RunInterrupted:
    """``err`` (Ctrl-C, or SIGTERM as ``servers.SignalInterrupt``) with the phase and the plan."""
    return RunInterrupted(int(getattr(err, "signum", signal.SIGINT)), phase, rerun_plan(cfg))
