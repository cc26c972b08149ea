"""SFT cold start: cross-entropy on gold trajectories, then an HF checkpoint RL starts from.

Gold trajectories are the data set's gold plans played through the real agent loop (same
tokens, masks and observations as rollouts), so the policy learns the action format on
exactly what RL will see. The stage writes ``<run_dir>/sft_model`` (safetensors, config and
tokenizer files) with a ``SFT_DONE`` marker; a resumed run with the marker skips the stage.

The batches of step k depend only on the seed and k (not on the number of steps), so a run
resumed from an SFT checkpoint after step k (``trainer/stages/drivers.py``: engine, optimizer, RNG)
trains on exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch

from ...bridge.weights import save_hf_checkpoint
from ...common import comm
from ...engine.rl_batch import RLBatch
from ...rollout.trajectory import Trajectory, collate
from ..rerun import SFT_DONE


def sft_batches(trajs: Sequence[Trajectory], batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Deterministic epoch-wise shuffled index batches over the gold trajectories."""
    if not trajs:
        raise ValueError("sft: no gold trajectories (does the data set carry gold plans?)")
    out, order, pos, epoch = [], [], 0, 0
    for _ in range(steps):
        batch = []
        while len(batch) < batch_size:
            if pos == len(order):
                order = torch.randperm(len(trajs), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
                pos, epoch = 0, epoch + 1
            batch.append(order[pos])
            pos += 1
        out.append(batch)
    return out


def run_sft(
    engine,
    trajs: Sequence[Trajectory],
    steps: int,
    batch_size: int,
    seed: int,
    pad_id: int,
    out_dir: Path,
    on_step: Callable[[int, dict], None] | None = None,
    start_step: int = 0,
    after_step: Callable[[int], None] | None = None,
) -> Path:
    """Train ``engine`` (a PolicyEngine) on gold batches from step ``start_step + 1`` (an engine
    restored from that step's checkpoint) to ``steps``; save an HF checkpoint. ``on_step(step,
    metrics)`` logs a step, then ``after_step(step)`` may checkpoint it (logged first: a step in
    a checkpoint is always in the log)."""
    for step, idx in enumerate(sft_batches(trajs, batch_size, steps, seed)[start_step:], start_step + 1):
        t = collate([trajs[i] for i in idx], pad_token_id=pad_id)
        metrics = engine.sft_update(
            RLBatch(input_ids=t["input_ids"], attention_mask=t["attention_mask"], loss_mask=t["loss_mask"])
        )
        if on_step is not None:
            on_step(step, metrics)
        if after_step is not None:
            after_step(step)
    save_hf_checkpoint(engine.model, str(out_dir))
    if comm.rank() == 0:
        (out_dir / SFT_DONE).write_text(json.dumps({"steps": steps}))
    comm.barrier()
    return out_dir
