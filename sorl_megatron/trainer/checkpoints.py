"""The RL checkpoints of one run (``<checkpoint.dir>/step_<k>``): the one a run resumes from,
the step each was saved after, saving (pruned to ``checkpoint.keep_last``) and restoring the
engines. What else a checkpoint carries (the rollout source's groups, PVPO's state) is handed in
by the loop, which owns those.

A save that fails because the disk is full (``ENOSPC`` or ``EDQUOT`` anywhere in the error's
chain, or the file system nearly full once it failed: megatron's writer reports it as e.g.
"unexpected pos 704 vs 598") is one :class:`CheckpointWriteError` naming the directory and the
space left; the step's partial save (``step_<k>.tmp``) is removed, and the earlier checkpoints
are untouched (nothing is pruned before a save has finished).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any, Optional

from ..common import comm
from ..engine.checkpoint import (
    complete_checkpoints,
    load_engine_checkpoint,
    newest_checkpoint,
    prune_checkpoints,
    read_checkpoint_meta,
    save_engine_checkpoint,
)
from .recipe.config import CheckpointConfig

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 16 * 2**20  # free space below which a failed save is taken for a full disk


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk is full); the message names the directory."""


def _disk_full(err: BaseException, where: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC/EDQUOT (or its words) in the error's chain,
    or the file system under ``where`` nearly full now."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        if "No space left" in str(e) or "Disk quota exceeded" in str(e):
            return True
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    try:
        return shutil.disk_usage(where).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def _one_line(err: BaseException) -> str:
    """What failed, in one line: the last line of the error (megatron's wraps a worker's traceback)."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    return (lines[-1] if lines else type(err).__name__)[:200]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


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
        """Save ``step_<step>``, then prune to ``checkpoint.keep_last``; a full disk is one
        :class:`CheckpointWriteError` (see the module doc)."""
        path = self.root / f"step_{step}"
        try:
            save_engine_checkpoint(str(path), actor, critic, extra=extra, files=files)
        except BaseException as err:  # torch's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)) or not _disk_full(err, self.root):
                raise
            partial = path.with_name(path.name + ".tmp")
            if comm.rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)  # its space back; a resume never reads it
            try:
                usage = shutil.disk_usage(self.root)
                space = f"{_size(usage.free)} free of {_size(usage.total)}"
            except OSError:
                space = "free space unknown"
            kept = [p.name for p in self.complete()]
            raise CheckpointWriteError(
                errno.ENOSPC, f"the checkpoint of RL step {step} could not be written to {self.root}: no space left on "
                f"the device ({space}; {_one_line(err)}). Its partial save was removed; the "
                f"earlier checkpoints are intact ({', '.join(kept) if kept else 'none yet'}). Free space there (or "
                "set checkpoint.dir elsewhere, or lower checkpoint.keep_last) and run the same command again"
            ) from None
        prune_checkpoints(self.root, self.cfg.keep_last)

    @staticmethod
    def load(path: Path, actor: Any, critic: Any) -> dict:
        """Load the engines' state from ``path``; returns what the loop saved beside it."""
        return load_engine_checkpoint(str(path), actor, critic)
