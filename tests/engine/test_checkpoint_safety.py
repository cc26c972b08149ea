"""Engine checkpoints: damage is detected and named before anything is deserialized, planted
pickles are refused before anything runs, and resume falls back past a damaged checkpoint.

The checkpoints are real ones (saved by the ws1 worker); the fallback tests copy them and
call :func:`newest_checkpoint` in this process (no process group: one rank hashes all).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from sorl_megatron.bridge.manifest import CheckpointDamagedError
from sorl_megatron.engine.checkpoint import complete_checkpoints, newest_checkpoint

from .ckpt_attacks import flip_bit, truncate


@pytest.fixture(scope="module")
def safety(ws1):
    r = ws1["ckpt_safety_ws1"]
    assert r["ok"], f"{r.get('error')}\n{r.get('traceback', '')}"
    return r


def _named(r, scenario: str, rel: str) -> str:
    err = r[scenario]
    assert err is not None, f"{scenario}: the damaged checkpoint loaded"
    path = os.path.join(os.path.dirname(r["base"]), f"safety_{scenario}", rel)
    assert path in err, f"{scenario}: {err!r} does not name {path}"
    return err


def test_flipped_bit_in_a_shard_names_the_file(safety):
    err = _named(safety, "flip", "actor/optim/__0_0.distcp")
    assert err.startswith("CheckpointDamagedError:") and "sha256 differs" in err


def test_truncated_missing_and_extra_files_are_named(safety):
    assert "bytes, the manifest says" in _named(safety, "truncate", "actor/model/__0_1.distcp")
    assert "missing" in _named(safety, "missing", "critic/engine.json")
    assert "not in the manifest" in _named(safety, "extra", "actor/model/__9_9.distcp")


@pytest.mark.parametrize(
    "scenario,rel,what",
    [
        ("rng_pickle", "rng/rank0.safetensors", "not a readable safetensors"),
        ("metadata_pickle", "actor/model/.metadata", "posix.system"),
        ("common_pt", "critic/optim/common.pt", "posix.system"),
        ("byte_item", "actor/model/__evil.distcp", "posix.system"),
        ("old_format", "rng/rank0.pt", "format 1"),
    ],
)
def test_planted_pickles_are_refused_and_nothing_runs(safety, scenario, rel, what):
    """The attacker rewrote the manifest too (it is not a signature): the formats and the
    pickle scan must stop the code by themselves."""
    assert what in _named(safety, scenario, rel)
    assert not safety["marker_created"] and not os.path.exists(safety["marker"])


def test_intact_checkpoint_still_loads_after_the_refusals(safety):
    assert safety["extra_after"] == {"step": 1}


def _runs(tmp_path, base, n):
    root = tmp_path / "ckpt"
    for k in range(1, n + 1):
        shutil.copytree(base, root / f"step_{k}")
    return root


def test_damaged_latest_falls_back_to_the_previous_with_a_warning(safety, tmp_path, caplog):
    root = _runs(tmp_path, safety["base"], 3)
    bad = root / "step_3" / "actor" / "model" / "__0_0.distcp"
    flip_bit(str(bad))
    (root / "step_2" / "MANIFEST.json").unlink()  # as if its save never finished
    shutil.copytree(root / "step_1", root / "step_4.tmp")  # a kill mid-save: never a candidate
    assert complete_checkpoints(root) == [root / "step_1", root / "step_3"]
    with caplog.at_level(logging.WARNING, logger="sorl_megatron.engine.checkpoint"):
        assert newest_checkpoint(root) == root / "step_1"
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(bad) in warned and str(root / "step_2" / "MANIFEST.json") in warned


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(safety, tmp_path):
    root = _runs(tmp_path, safety["base"], 2)
    truncate(str(root / "step_1" / "trainer.json"), 3)
    flip_bit(str(root / "step_2" / "critic" / "model" / "__0_1.distcp"))
    with pytest.raises(CheckpointDamagedError, match="no intact checkpoint") as e:
        newest_checkpoint(root)
    assert str(root / "step_1" / "trainer.json") in str(e.value)
    assert str(root / "step_2" / "critic" / "model" / "__0_1.distcp") in str(e.value)
    assert newest_checkpoint(tmp_path / "nothing_here") is None
