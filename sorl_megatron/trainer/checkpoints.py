"""The RL checkpoints of one run (``<checkpoint.dir>/step_<k>``): the one a run resumes from,
the step each was saved after, saving (pruned to ``checkpoint.keep_last``) and restoring the
engines. What else a checkpoint carries (the rollout source's groups, PVPO's state) is handed in
by the loop, which owns those."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..engine.checkpoint import (
    complete_checkpoints,
    load_engine_checkpoint,
    newest_checkpoint,
    prune_checkpoints,
    read_checkpoint_meta,
    save_engine_checkpoint,
)
from .recipe.config import CheckpointConfig


class RunCheckpoints:
    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        self.root = Path(cfg.dir)

    def resume_point(self) -> Optional[Path]:
        """The checkpoint ``checkpoint.resume`` names: none, a given one, or (auto) the newest verified."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume)
            if not (path / "trainer.json").is_file():
                raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no trainer.json)")
            return path
        return newest_checkpoint(self.root)  # verified; a damaged newer one is skipped with a warning

    @staticmethod
    def step_of(path: Path) -> int:
        """The RL step a checkpoint was saved after (its ``trainer.json``; nothing else is read)."""
        _, _, extra = read_checkpoint_meta(path)
        try:
            return int(extra["step"])
        except (KeyError, TypeError, ValueError):
            raise FileNotFoundError(f"{path}/trainer.json: no trainer step (not a training run's checkpoint)") from None

    def complete(self) -> list[Path]:
        """``step_<k>`` checkpoints whose save finished, oldest first (not ``.tmp`` / ``.old``)."""
        return complete_checkpoints(self.root)

    def save(self, step: int, actor: Any, critic: Any, extra: dict, files: dict) -> None:
        save_engine_checkpoint(str(self.root / f"step_{step}"), actor, critic, extra=extra, files=files)
        prune_checkpoints(self.root, self.cfg.keep_last)

    @staticmethod
    def load(path: Path, actor: Any, critic: Any) -> dict:
        """Load the engines' state from ``path``; returns what the loop saved beside it."""
        return load_engine_checkpoint(str(path), actor, critic)
