"""Checkpoint and resume of the RL engines (actor, optional critic): atomic, verified, and in
formats that cannot run code.

Layout of a checkpoint directory::

    <dir>/actor/                save_megatron_checkpoint (dist_ckpt.py): model/, hf/, sorl_megatron.json
    <dir>/actor/optim/          megatron dist_checkpointing of the optimizer (Adam moments under the
                                parameters' global sharded names, so any layout can load them)
    <dir>/actor/engine.json     LR-scheduler state, the optimizer step counter, engine state (e.g.
                                the relative clip-bias form's running mean)
    <dir>/critic/...            the same for the critic
    <dir>/rng/rank{r}.safetensors  torch (+ cuda) and megatron RNG-tracker states of rank r
    <dir>/rng/rank{r}.json      Python ``random`` and NumPy states of rank r (restored when the
                                world size matches; otherwise the engines keep their seeds)
    <dir>/trainer.json          format version, world size and the caller's ``extra``
    <dir>/MANIFEST.json         size and sha256 of every file above, written last

Everything is written to ``<dir>.tmp``; once all ranks have finished, the manifest is
written and rank 0 renames the directory to ``<dir>``, so a crash mid-save never leaves a
half-written ``<dir>`` (an older ``<dir>`` is replaced only once the new one is complete).

Loading verifies the manifest before anything in the directory is read, then scans the
pickles megatron / torch DCP will unpickle (dist_ckpt.check_dist_checkpoint). Our own state
is JSON or safetensors. Checkpoints from before the manifest (``engine.pt``, ``rng/*.pt``
pickles) are refused with an error that says so.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..bridge.dist_ckpt import (
    _sharded_state_dict,
    load_dist_checkpoint,
    load_megatron_checkpoint_into,
    save_megatron_checkpoint,
)
from ..bridge.hf_config import CheckpointFileError
from ..bridge.manifest import (
    MANIFEST_FILE,
    CheckpointDamagedError,
    verify_manifest,
    write_manifest,
)
from ..common import comm
from .base import EngineBase

FORMAT_VERSION = 2  # 1: pickled engine.pt / rng/rank*.pt, no manifest
log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)")


def _tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


# ---------------------------------------------------------------- RNG state (no pickles)


def _save_rng(rng_dir: str) -> None:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    tensors.update({f"tracker/{name}": state for name, state in _tracker().get_states().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(rng_dir, f"rank{comm.rank()}.safetensors"))
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    with open(os.path.join(rng_dir, f"rank{comm.rank()}.json"), "w") as f:
        json.dump(state, f)


def _load_rng(rng_dir: str) -> None:
    path = os.path.join(rng_dir, f"rank{comm.rank()}.safetensors")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointFileError(f"{path}: not a readable safetensors RNG state ({e})") from None
    tracker = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")}
    current = set(_tracker().get_states())
    if set(tracker) != current or "torch" not in tensors:
        raise CheckpointFileError(f"{path}: RNG states {sorted(tensors)}, expected torch and tracker/{sorted(current)}")
    if any(t.dtype != torch.uint8 or t.dim() != 1 for t in tensors.values()):
        raise CheckpointFileError(f"{path}: RNG states must be 1-D uint8 tensors")
    json_path = os.path.join(rng_dir, f"rank{comm.rank()}.json")
    try:
        with open(json_path) as f:
            state = json.load(f)
        version, internal, gauss = state["python"]
        py_state = (version, tuple(internal), gauss)
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np_state = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
        random.Random().setstate(py_state)  # validate both before changing anything
        np.random.RandomState().set_state(np_state)
        torch.Generator().set_state(tensors["torch"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointFileError(f"{json_path} / {path}: bad RNG state ({type(e).__name__}: {e})") from None
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available() and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"])
    _tracker().set_states(tracker)
    random.setstate(py_state)
    np.random.set_state(np_state)


# ---------------------------------------------------------------- engines


# The distributed optimizer's state in model space, resharded on load (any DP/TP/PP): megatron
# 0.16's default for it ("fully_sharded_model_space") builds flattened-range sharded tensors
# that its own dist_checkpointing refuses ("ShardedTensor.flattened_range is not supported").
# The other optimizers ignore the key.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _save_engine(engine: EngineBase, path: str) -> None:
    with engine.on_device():  # an offloaded critic (model.offload_idle) saves from the GPU
        _save_engine_state(engine, path)


def _save_engine_state(engine: EngineBase, path: str) -> None:
    from megatron.core import dist_checkpointing

    save_megatron_checkpoint(engine.model, path, extra={"step": engine.step}, manifest=False)
    if engine.optimizer is None:
        return
    optim_dir = os.path.join(path, "optim")
    if comm.rank() == 0:
        os.makedirs(optim_dir, exist_ok=True)
    comm.barrier()
    model_sd = _sharded_state_dict(engine.model)
    optimizer_sd = engine.optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
    dist_checkpointing.save({"optimizer": optimizer_sd}, optim_dir)
    if comm.rank() == 0:
        with open(os.path.join(path, "engine.json"), "w") as f:
            state = {"scheduler": engine.scheduler.state_dict(), "step": engine.step, "engine": engine.extra_state()}
            json.dump(state, f, indent=1)


def _load_engine(engine: EngineBase, path: str) -> None:
    if not os.path.isdir(path):
        raise CheckpointFileError(f"engine checkpoint {path!r} does not exist")
    with engine.on_device():
        _load_engine_state(engine, path)


def _load_engine_state(engine: EngineBase, path: str) -> None:
    load_megatron_checkpoint_into(engine.model, path, verify=False)  # the caller verified the manifest
    if engine.optimizer is None:
        return
    state_path = os.path.join(path, "engine.json")
    if not os.path.isfile(state_path) or not os.path.isdir(os.path.join(path, "optim")):
        raise CheckpointFileError(f"{path!r} has no optimizer state (optim/, engine.json): saved without an optimizer?")
    try:
        with open(state_path) as f:
            state = json.load(f)
        scheduler, step, extra = state["scheduler"], int(state["step"]), dict(state.get("engine", {}))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"{state_path}: bad engine state ({type(e).__name__}: {e})") from None
    model_sd = _sharded_state_dict(engine.model)
    sharded = {"optimizer": engine.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)}
    loaded = load_dist_checkpoint(sharded, os.path.join(path, "optim"))
    engine.optimizer.load_state_dict(loaded["optimizer"])
    engine.scheduler.load_state_dict(scheduler)
    engine.step = step
    engine.load_extra_state(extra)


def save_engine_checkpoint(
    ckpt_dir: str, actor: EngineBase, critic: Optional[EngineBase] = None, extra: Optional[dict] = None,
    files: Optional[dict[str, bytes]] = None,
) -> None:
    """Save actor (+ critic) weights, optimizer states, LR schedules, step counters and RNG.

    All ranks call it. ``extra`` must be JSON-serializable; ``files`` (rank 0's: path relative to
    the checkpoint -> bytes, e.g. the trainer's pending rollout batches) are written beside it and
    covered by the manifest. Written to ``ckpt_dir + '.tmp'``, manifest last, then renamed (atomic
    on one file system).
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    tmp = ckpt_dir + ".tmp"
    meta = {"format_version": FORMAT_VERSION, "world_size": comm.world_size(),
            "has_critic": critic is not None, "actor_step": actor.step, "extra": extra or {}}
    body = json.dumps(meta, indent=2)  # fails here, before anything is written, if extra is not JSON
    if comm.rank() == 0:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, "rng"))
    comm.barrier()
    _save_engine(actor, os.path.join(tmp, "actor"))
    if critic is not None:
        _save_engine(critic, os.path.join(tmp, "critic"))
    _save_rng(os.path.join(tmp, "rng"))
    if comm.rank() == 0:
        for rel, data in (files or {}).items():
            path = os.path.join(tmp, rel)
            if os.path.commonpath([tmp, os.path.abspath(path)]) != tmp:
                raise ValueError(f"checkpoint file {rel!r} is outside the checkpoint")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            f.write(body)
    comm.barrier()
    write_manifest(tmp)  # last: every rank has finished writing
    comm.barrier()
    if comm.rank() == 0:
        old = ckpt_dir + ".old"
        if os.path.exists(ckpt_dir):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(ckpt_dir, old)
        os.rename(tmp, ckpt_dir)
        if os.path.exists(old):
            shutil.rmtree(old)
    comm.barrier()


def _refuse_old_format(ckpt_dir: str) -> None:
    if os.path.isfile(os.path.join(ckpt_dir, MANIFEST_FILE)):
        return
    for old in ("rng/rank0.pt", "actor/engine.pt"):
        if os.path.isfile(os.path.join(ckpt_dir, old)):
            raise CheckpointFileError(
                f"{os.path.join(ckpt_dir, old)}: {ckpt_dir!r} is an engine checkpoint of format 1 (pickled state, "
                "no manifest), which is no longer loaded because a pickle can run code; restart from an HF "
                "checkpoint (checkpoint.resume=none, model.path=...)"
            )


def read_checkpoint_meta(ckpt_dir: Union[str, Path]) -> tuple[int, bool, dict]:
    """``(world_size, has_critic, extra)`` of a checkpoint's ``trainer.json`` (the caller's
    ``extra`` holds e.g. the trainer's step), without loading anything else; a missing or
    malformed file is a CheckpointFileError naming it."""
    meta_path = os.path.join(ckpt_dir, "trainer.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        world_size, has_critic, extra = int(meta["world_size"]), bool(meta["has_critic"]), dict(meta["extra"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointFileError(f"{meta_path}: not a complete engine checkpoint ({type(e).__name__}: {e})") from None
    return world_size, has_critic, extra


def load_engine_checkpoint(ckpt_dir: str, actor: EngineBase, critic: Optional[EngineBase] = None) -> dict:
    """Restore what :func:`save_engine_checkpoint` wrote into already built engines (any layout).

    All ranks call it. The manifest is verified first (CheckpointDamagedError names the bad
    file); unsafe pickles are refused (UnsafeCheckpointError). Returns the caller's ``extra``.
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointFileError(f"engine checkpoint {ckpt_dir!r} does not exist")
    _refuse_old_format(ckpt_dir)
    verify_manifest(ckpt_dir)
    world_size, has_critic, extra = read_checkpoint_meta(ckpt_dir)
    _load_engine(actor, os.path.join(ckpt_dir, "actor"))
    if critic is not None:
        if not has_critic:
            raise CheckpointFileError(f"{ckpt_dir!r} has no critic")
        _load_engine(critic, os.path.join(ckpt_dir, "critic"))
    if world_size == comm.world_size():
        _load_rng(os.path.join(ckpt_dir, "rng"))
    comm.barrier()
    return extra


# ---------------------------------------------------------------- finding the one to resume


def _step_dirs(root: Union[str, Path]) -> list[Path]:
    """``step_<k>`` directories under ``root``, oldest first (``.tmp`` / ``.old`` are not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def complete_checkpoints(root: Union[str, Path]) -> list[Path]:
    """``step_<k>`` checkpoints under ``root`` whose save finished (the manifest, written last,
    exists), oldest first. Not verified: see :func:`newest_checkpoint`."""
    return [p for p in _step_dirs(root) if (p / MANIFEST_FILE).is_file()]


def prune_checkpoints(root: Union[str, Path], keep_last: int) -> None:
    """Rank 0 removes all but the newest ``keep_last`` complete checkpoints under ``root``
    (``checkpoint.keep_last``; 0 keeps them all)."""
    if comm.rank() == 0 and keep_last > 0:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def newest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The newest ``step_<k>`` under ``root`` whose manifest verifies, or None when there is none.

    All ranks call it (verification is shared among them; rank 0's listing is used). A newer
    damaged or incomplete checkpoint is skipped with a warning naming the bad file. If there
    are ``step_<k>`` directories but none verifies, raises CheckpointDamagedError: starting
    over would silently discard the run (``checkpoint.resume=none`` does that on purpose).
    """
    candidates = comm.broadcast_object([str(p) for p in _step_dirs(root)] if comm.rank() == 0 else None)
    skipped: list[CheckpointDamagedError] = []
    for path in reversed(candidates):
        try:
            verify_manifest(path)
            return Path(path)
        except CheckpointDamagedError as e:
            if comm.rank() == 0:
                log.warning("checkpoint %s is damaged, falling back to an older one: %s", path, e)
            skipped.append(e)
    if skipped:
        raise CheckpointDamagedError(
            skipped[0].path,
            f"no intact checkpoint under {root} to resume from (checkpoint.resume=none starts over); damaged: "
            + "; ".join(str(e) for e in skipped),
        )
    return None
