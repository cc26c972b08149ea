"""checkpoint.dir belongs to one run (issue 49, item 4): it is locked with the run, and it
carries the run's defining settings (``run_settings.json`` there, and each RL checkpoint's
``trainer.json``), so a run with another name or other settings pointed at another run's
checkpoint directory is refused, naming the difference, even once ``config.yaml`` is gone;
``retrieval.corpus`` is a defining setting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sorl_megatron.common.run_lock import acquire_run_lock
from sorl_megatron.engine.checkpoint import FORMAT_VERSION, MANIFEST_FILE
from sorl_megatron.trainer.recipe.inputs import InputError, check_resume_dir
from sorl_megatron.trainer.recipe.loader import dump_config, load_recipe
from sorl_megatron.trainer.recipe.run_settings import (
    CHECKPOINT_SETTINGS,
    SETTINGS_ENTRY,
    defining_settings,
    write_checkpoint_dir_record,
)

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "tiny_search_base.yaml"


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_recipe(BASE, [f"logging.dir={tmp_path}", f"logging.run_name={name}", "schedule.total_steps=4",
                              "model.path=m/model", "data.train=d/train.parquet", "retrieval.corpus=c/corpus.jsonl",
                              *extra])


def _started(cfg) -> None:
    """What the trainer leaves when a run starts: config.yaml in the run directory, the record in
    checkpoint.dir."""
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    write_checkpoint_dir_record(cfg)


def _checkpoint(cfg, step: int) -> Path:
    """An RL checkpoint's trainer.json as the trainer writes it (its extra carries the settings)."""
    path = Path(cfg.checkpoint.dir) / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "world_size": 1, "has_critic": False,
        "extra": {"step": step, SETTINGS_ENTRY: defining_settings(cfg)}}))
    (path / MANIFEST_FILE).write_text("{}")
    return path


def test_a_run_pointed_at_another_runs_checkpoint_dir_is_refused(tmp_path):
    first = _cfg(tmp_path, "first")
    _started(first)
    ckpt = first.checkpoint.dir
    record = json.loads((Path(ckpt) / CHECKPOINT_SETTINGS).read_text())
    assert record["run_dir"] == os.path.abspath(tmp_path / "first")
    assert record["settings"]["retrieval.corpus"] == "c/corpus.jsonl"
    check_resume_dir(first)  # its own: fine
    # another name and another loss, pointed at the first run's checkpoints
    other = _cfg(tmp_path, "second", "algorithm.loss.name=grpo", f"checkpoint.dir={ckpt}")
    with pytest.raises(InputError) as err:
        check_resume_dir(other)
    text = str(err.value)
    assert f"checkpoint.dir={ckpt}" in text and str(tmp_path / "first") in text, text
    # the same settings under another name: still another run's checkpoints
    with pytest.raises(InputError, match="holds the checkpoints of another run"):
        check_resume_dir(_cfg(tmp_path, "third", f"checkpoint.dir={ckpt}"))
    # deleting config.yaml does not turn the guard off
    (tmp_path / "first" / "config.yaml").unlink()
    with pytest.raises(InputError, match="algorithm.loss.name: 'so_grpo' there, 'grpo' now"):
        check_resume_dir(_cfg(tmp_path, "first", "algorithm.loss.name=grpo"))


def test_the_checkpoint_itself_carries_the_settings(tmp_path):
    cfg = _cfg(tmp_path, "run")
    _started(cfg)
    _checkpoint(cfg, 1)
    (tmp_path / "run" / "config.yaml").unlink()
    (Path(cfg.checkpoint.dir) / CHECKPOINT_SETTINGS).unlink()
    with pytest.raises(InputError, match=r"schedule.seed: 1234 there, 7 now") as err:
        check_resume_dir(_cfg(tmp_path, "run", "schedule.seed=7"))
    assert "step_1/trainer.json" in str(err.value)
    check_resume_dir(_cfg(tmp_path, "run", "schedule.total_steps=8"))  # the same run, extended
    check_resume_dir(_cfg(tmp_path, "run", "schedule.seed=7", "checkpoint.resume=none"))  # a new start, on purpose


def test_the_corpus_defines_the_run(tmp_path):
    _started(_cfg(tmp_path, "run"))
    with pytest.raises(InputError, match=r"retrieval.corpus: 'c/corpus.jsonl' there, 'x/other.jsonl' now"):
        check_resume_dir(_cfg(tmp_path, "run", "retrieval.corpus=x/other.jsonl"))
    check_resume_dir(_cfg(tmp_path, "run", f"retrieval.corpus={os.path.abspath('c/corpus.jsonl')}"))  # same file


def test_train_refuses_a_checkpoint_dir_in_use(tmp_path, monkeypatch, capsys):
    import sorl_megatron.train as train

    monkeypatch.setattr(train, "validate_layout_for_launch", lambda cfg, world: None)  # no model files here
    monkeypatch.delenv("RANK", raising=False)
    shared = tmp_path / "shared_ckpt"
    with acquire_run_lock(shared, what="checkpoint.dir", kind="checkpoint directory"):  # another run holds it
        code = train.main(["--config", str(BASE), f"logging.dir={tmp_path}", "logging.run_name=mine",
                           f"checkpoint.dir={shared}"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"checkpoint directory {shared} is in use: pid {os.getpid()}" in err, err
    assert "checkpoint.dir=" in err and not (tmp_path / "mine").exists()
