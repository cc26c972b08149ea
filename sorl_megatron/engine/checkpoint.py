"""Checkpoint and resume of the RL engines (actor, optional critic), atomically.

Layout of a checkpoint directory::

    <dir>/actor/            save_megatron_checkpoint (dist_ckpt.py): model/, hf/, sorl_megatron.json
    <dir>/actor/optim/      megatron dist_checkpointing of the optimizer (Adam moments under the
                            parameters' global sharded names, so any layout can load them)
    <dir>/actor/engine.pt   LR-scheduler state and the optimizer step counter
    <dir>/critic/...        the same for the critic
    <dir>/rng/rank{r}.pt    torch + megatron RNG-tracker states per rank (restored when the
                            world size matches; otherwise the engines keep their seeds)
    <dir>/trainer.json      the caller's `extra` (e.g. the trainer step, data cursor)

Everything is written to ``<dir>.tmp`` and renamed to ``<dir>`` by rank 0 after a barrier,
so a crash mid-save never leaves a half-written ``<dir>`` (an older ``<dir>`` is replaced
only once the new one is complete).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from ..bridge.dist_ckpt import _sharded_state_dict, load_megatron_checkpoint_into, save_megatron_checkpoint
from ..bridge.hf_config import CheckpointFileError
from .base import EngineBase


def _rank() -> int:
    return torch.distributed.get_rank()


def _barrier() -> None:
    torch.distributed.barrier()


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _save_engine(engine: EngineBase, path: str) -> None:
    from megatron.core import dist_checkpointing

    save_megatron_checkpoint(engine.model, path, extra={"step": engine.step})
    if engine.optimizer is None:
        return
    optim_dir = os.path.join(path, "optim")
    if _rank() == 0:
        os.makedirs(optim_dir, exist_ok=True)
    _barrier()
    model_sd = _sharded_state_dict(engine.model)
    dist_checkpointing.save({"optimizer": engine.optimizer.sharded_state_dict(model_sd)}, optim_dir)
    if _rank() == 0:
        torch.save({"scheduler": engine.scheduler.state_dict(), "step": engine.step}, os.path.join(path, "engine.pt"))


def _load_engine(engine: EngineBase, path: str) -> None:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise CheckpointFileError(f"engine checkpoint {path!r} does not exist")
    load_megatron_checkpoint_into(engine.model, path)
    if engine.optimizer is None:
        return
    state_path = os.path.join(path, "engine.pt")
    if not os.path.isfile(state_path) or not os.path.isdir(os.path.join(path, "optim")):
        raise CheckpointFileError(f"{path!r} has no optimizer state (optim/, engine.pt): saved without an optimizer?")
    model_sd = _sharded_state_dict(engine.model)
    sharded = {"optimizer": engine.optimizer.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(sharded, os.path.join(path, "optim"))
    engine.optimizer.load_state_dict(loaded["optimizer"])
    state = torch.load(state_path, weights_only=False)
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.step = int(state["step"])


def save_engine_checkpoint(
    ckpt_dir: str, actor: EngineBase, critic: Optional[EngineBase] = None, extra: Optional[dict] = None
) -> None:
    """Save actor (+ critic) weights, optimizer states, LR schedules, step counters and RNG.

    All ranks call it. Written to ``ckpt_dir + '.tmp'`` then renamed (atomic on one file system).
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    tmp = ckpt_dir + ".tmp"
    if _rank() == 0:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    _save_engine(actor, os.path.join(tmp, "actor"))
    if critic is not None:
        _save_engine(critic, os.path.join(tmp, "critic"))
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{_rank()}.pt"))
    if _rank() == 0:
        meta = {"world_size": torch.distributed.get_world_size(), "has_critic": critic is not None,
                "actor_step": actor.step, "extra": extra or {}}
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump(meta, f, indent=2)
    _barrier()
    if _rank() == 0:
        old = ckpt_dir + ".old"
        if os.path.exists(ckpt_dir):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(ckpt_dir, old)
        os.rename(tmp, ckpt_dir)
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier()


def load_engine_checkpoint(ckpt_dir: str, actor: EngineBase, critic: Optional[EngineBase] = None) -> dict:
    """Restore what :func:`save_engine_checkpoint` wrote into already built engines (any layout).

    Returns the caller's ``extra`` dict.
    """
    meta_path = os.path.join(ckpt_dir, "trainer.json")
    if not os.path.isfile(meta_path):
        raise CheckpointFileError(f"{meta_path} not found: {ckpt_dir!r} is not a complete engine checkpoint")
    with open(meta_path) as f:
        meta = json.load(f)
    _load_engine(actor, os.path.join(ckpt_dir, "actor"))
    if critic is not None:
        if not meta["has_critic"]:
            raise CheckpointFileError(f"{ckpt_dir!r} has no critic")
        _load_engine(critic, os.path.join(ckpt_dir, "critic"))
    rng = os.path.join(ckpt_dir, "rng", f"rank{_rank()}.pt")
    if meta["world_size"] == torch.distributed.get_world_size() and os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    _barrier()
    return meta["extra"]
