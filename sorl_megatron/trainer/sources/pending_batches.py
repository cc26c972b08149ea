"""The batches a ``lagged`` (or ``one_step_off``) run generated ahead of its checkpoint, saved in
it so that a resumed run trains on exactly the batches the uninterrupted run would have.

At a checkpoint after step ``k`` the source holds the batches of steps ``k + 1 ... k + lag``,
generated on the weights of steps ``k + 1 - lag ... k``; the checkpoint holds only step ``k``'s.
Without them a resume would regenerate those batches on step ``k``'s weights (a shorter lag for
``lag`` steps). Two files in the checkpoint's ``rollout/`` (covered by its manifest): every array
of every trajectory in a safetensors file, everything else in JSON. No pickle: a checkpoint can
be handed to someone else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...rollout.trajectory import Trajectory
from ..groups.producer import Group

FORMAT = 1
JSON_FILE = "rollout/pending.json"
ARRAYS_FILE = "rollout/pending.safetensors"

# what a source's generating call returns: the batch's groups, the groups drawn and dropped (with
# why), and the counts (``RolloutSource.collect``)
Collected = tuple[list[Group], list[tuple[Group, str]], dict[str, float]]

_TRAJECTORY_FIELDS = [f.name for f in dataclasses.fields(Trajectory)]


def encode(batches: list[Collected], next_gid: int) -> dict[str, bytes]:
    """The checkpoint files (path relative to the checkpoint -> bytes) of ``batches``, in step
    order; ``next_gid`` is the first group none of them drew."""
    from safetensors.numpy import save

    arrays: dict[str, np.ndarray] = {}
    described = []
    for b, (accepted, dropped, counts) in enumerate(batches):
        groups = [(g, "accepted") for g in accepted] + list(dropped)
        entries = []
        for j, (group, status) in enumerate(groups):
            key = f"b{b}.g{j}"
            for name in ("rewards", "injected"):
                value = getattr(group, name)
                if value is not None:
                    arrays[f"{key}.{name}"] = value.numpy()
            trajectories = []
            for k, traj in enumerate(group.trajectories):
                scalars = {}
                for name in _TRAJECTORY_FIELDS:
                    value = getattr(traj, name)
                    if isinstance(value, np.ndarray):
                        arrays[f"{key}.t{k}.{name}"] = np.ascontiguousarray(value)
                    elif value is not None:
                        scalars[name] = value
                trajectories.append(scalars)
            entries.append({"gid": group.gid, "prompt": group.prompt, "status": status,
                            "finished_at": group.finished_at, "trajectories": trajectories})
        described.append({"groups": entries, "counts": counts})
    body = {"format": FORMAT, "next_gid": next_gid, "batches": described}
    # a TypeError here, before the checkpoint is written, if a trajectory carries what JSON cannot hold
    return {JSON_FILE: json.dumps(body, default=_plain).encode(), ARRAYS_FILE: save(arrays)}


def _plain(value: Any) -> Any:
    """A numpy scalar (a dataset index, say) as the Python number it holds."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON: cannot save it with the pending batches")


def decode(ckpt_dir: str | Path) -> tuple[list[Collected], int]:
    """``(batches, next_gid)`` saved in a checkpoint; ``([], 0)`` when it holds none (a sync run,
    an empty pipeline, a checkpoint from before this file existed)."""
    from safetensors.numpy import load_file

    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / JSON_FILE
    if not path.is_file():
        return [], 0
    body = json.loads(path.read_text())
    if body.get("format") != FORMAT:
        raise ValueError(f"{path}: pending batches of format {body.get('format')!r}, this version reads {FORMAT}")
    arrays = load_file(str(ckpt_dir / ARRAYS_FILE))
    batches: list[Collected] = []
    try:
        for b, described in enumerate(body["batches"]):
            accepted, dropped = [], []
            for j, entry in enumerate(described["groups"]):
                key = f"b{b}.g{j}"
                trajectories = []
                for k, scalars in enumerate(entry["trajectories"]):
                    found = {n: arrays[f"{key}.t{k}.{n}"] for n in _TRAJECTORY_FIELDS if f"{key}.t{k}.{n}" in arrays}
                    trajectories.append(Trajectory(**scalars, **found))
                group = Group(int(entry["gid"]), int(entry["prompt"]), trajectories,
                              finished_at=float(entry["finished_at"]), **_tensors(arrays, key))
                if entry["status"] == "accepted":
                    accepted.append(group)
                else:
                    dropped.append((group, str(entry["status"])))
            batches.append((accepted, dropped, {k: float(v) for k, v in described["counts"].items()}))
        return batches, int(body["next_gid"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: pending batches unreadable ({type(err).__name__}: {err})") from None


def _tensors(arrays: dict[str, Any], key: str) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(arrays[f"{key}.{name}"].copy()) for name in ("rewards", "injected")
            if f"{key}.{name}" in arrays}
