"""Rank 0 holds a step's routes packed from the start (issue: it collated them as a dense int32
``[B, S, L, K]``: 51.5 GB of host memory at the Qwen3-30B recipe's shape)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from sorl_megatron.engine.rl_batch import RoutedRows
from sorl_megatron.trainer.recipe.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]

# B=64 rows of 1,024-8,192 tokens, Qwen3-30B-A3B's 48 layers x top-8 over 128 experts (int8)
SCRIPT = """
import resource, sys
import numpy as np
from sorl_megatron.rollout.trajectory import Trajectory, collate
rng = np.random.default_rng(0)
trajs = []
for n in rng.integers(1024, 8193, size=64):
    trajs.append(Trajectory(token_ids=np.zeros(n, np.int64), loss_mask=np.zeros(n, np.int8),
                            turn_ids=np.zeros(n, np.int32), rollout_logprobs=np.zeros(n, np.float32), prompt_len=1,
                            finish_reason="answer", num_turns=1, num_searches=0,
                            routed_experts=rng.integers(0, 128, size=(n, 48, 8), dtype=np.int8)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
batch = collate(trajs, pad_token_id=0)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
routes = batch["routed_experts"]
print(grew * 1024, routes.values.nbytes, 64 * int(max(len(t) for t in trajs)) * 48 * 8 * 4)
"""


def test_collate_grows_rank_0_by_the_packed_routes_not_the_dense_tensor():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    grew, packed, dense = map(int, out.stdout.split())
    # the packed copy (~113 MB) plus the batch's small per-token fields; the dense int32 was ~800 MB
    assert packed < dense / 6 and grew < packed + 150 * 2**20, (grew, packed, dense)


def test_at_the_qwen3_30b_recipes_shape_the_routes_are_bounded():
    """The Qwen3-30B-A3B recipe's step on rank 0, as meta tensors (nothing allocated): every
    trajectory at its longest, the routes packed in int8 (128 experts) are a quarter of the dense
    int32 tensor of before, and without padding the step's real tokens are what they cost."""
    cfg = load_recipe(ROOT / "recipes/gpu/minirl_qwen3_30b_a3b_r3.yaml")
    rows = cfg.schedule.batch_size * cfg.rollout.group_size
    seq, layers, top_k = cfg.rollout.max_total_tokens, 48, 8
    dense = torch.empty((rows, seq, layers, top_k), dtype=torch.int32, device="meta")
    lengths = torch.full((rows,), seq)
    packed = RoutedRows(rows=torch.arange(rows), lengths=lengths, batch_size=rows, seq_len=seq,
                        values=torch.empty((int(lengths.sum()), layers, top_k), dtype=torch.int8, device="meta"))
    dense_bytes = dense.numel() * dense.element_size()
    packed_bytes = packed.values.numel() * packed.values.element_size()
    assert rows == 4096 and round(dense_bytes / 1e9, 1) == 51.5
    assert packed_bytes * 4 == dense_bytes and packed_bytes / 1e9 < 13
    assert packed.shape == tuple(dense.shape)
