"""A full disk during a checkpoint (issue 49, item 6): one line naming the checkpoint directory
and "no space left", no traceback, the partial save removed and the earlier checkpoints intact
(verified: the same command resumes from them). Before, megatron's writer failed with a
traceback ("unexpected pos 704 vs 598") that said neither.

The disk fills in a subprocess run of the trainer's command line (``signal_driver.py``): from the
checkpoint of step 2 on, every shard file torch.distributed.checkpoint writes fails with
``OSError(ENOSPC)``, as a full file system answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sorl_megatron.engine.checkpoint import newest_checkpoint

from .e2e_helpers import BASE_RECIPE, ROOT, make_tiny_data, run_overrides, subprocess_env

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("signal_driver.py")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("disk_full_data"))


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_earlier_ones(tiny_data, tmp_path):
    args = ["--config", BASE_RECIPE, *run_overrides(tiny_data, tmp_path, "run", "schedule.total_steps=2",
                                                    "checkpoint.save_every=1", "checkpoint.keep_last=1",
                                                    "logging.progress=none")]
    proc = subprocess.run([sys.executable, str(DRIVER), "checkpoint", "2", "ENOSPC", *args], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    err = proc.stderr
    assert "SENT checkpoint 2" in err, err[-4000:]
    ckpt = tmp_path / "run" / "ckpt"
    assert proc.returncode == 1, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"checkpoint error: the checkpoint of RL step 2 could not be written to {ckpt}: no space "
                           "left on the device"), line
    assert "earlier checkpoints are intact (step_1)" in line, line
    assert not (ckpt / "step_2.tmp").exists() and not (ckpt / "step_2").exists()
    assert newest_checkpoint(ckpt) == ckpt / "step_1"  # verified against its manifest
