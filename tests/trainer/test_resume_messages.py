"""A run says what it does: starts, resumes from step k of N, or is finished (issue 21)."""

import json
import logging
from pathlib import Path

import pytest

from sorl_megatron.bridge.manifest import write_manifest
from sorl_megatron.engine.checkpoint import FORMAT_VERSION
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.rl_loop import RLTrainer, start_message

BASE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_search_base.yaml"


@pytest.fixture(autouse=True)
def _no_process_group(monkeypatch):
    """A world of one without torch.distributed: the checkpoint helpers work without a group, and
    none is left up in the test process."""
    import sorl_megatron.trainer.rl_loop as rl_loop

    monkeypatch.setattr(rl_loop, "init_distributed", lambda **kw: None)


def _cfg(tmp_path, *extra):
    return load_recipe(BASE, [f"logging.dir={tmp_path}", "logging.run_name=mine", "schedule.total_steps=4",
                              "logging.progress=none", "logging.tensorboard=false", *extra])


def _fake_checkpoint(root: Path, step: int) -> Path:
    """What the trainer reads to decide where a run stands: trainer.json under a verified manifest."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "world_size": 1,
                                                   "has_critic": False, "actor_step": step, "extra": {"step": step}}))
    write_manifest(str(path))
    return path


def test_start_resume_and_finished_lines(tmp_path):
    cfg = _cfg(tmp_path)
    go, text = start_message(cfg, None, 0)
    assert go and text == f"starting run mine: 4 RL steps, logs and checkpoints in {tmp_path / 'mine'}"
    go, text = start_message(cfg, Path("ck/step_2"), 2)
    assert go and text == "resuming run mine from step 2 of 4 (ck/step_2)"
    go, text = start_message(cfg, Path("ck/step_4"), 4)
    assert not go
    assert text.startswith("run mine is finished: its checkpoint ck/step_4 is at step 4 of schedule.total_steps=4.")
    assert "schedule.total_steps=8" in text and "checkpoint.resume=none" in text and str(tmp_path / "mine") in text
    # a checkpoint past a lowered total_steps is finished too; extending means going past it
    go, text = start_message(cfg, Path("ck/step_6"), 6)
    assert not go and "step 6 of schedule.total_steps=4" in text and "schedule.total_steps=10" in text


@pytest.mark.parametrize("extra,extendable", [([], True), (["optimizer.lr_schedule=cosine"], False),
                                              (["optimizer.lr_schedule=cosine", "optimizer.decay_steps=100"], True)])
def test_a_run_whose_lr_decays_over_its_length_is_not_offered_an_extension(tmp_path, extra, extendable):
    _, text = start_message(_cfg(tmp_path, *extra), Path("ck/step_4"), 4)
    assert ("schedule.total_steps=8" in text) == extendable
    assert ("cannot be extended" in text) != extendable


def test_a_finished_run_says_so_and_reads_nothing_else(tmp_path, caplog):
    """The recipe's model and data paths do not exist here: a finished run stops before them."""
    cfg = _cfg(tmp_path, "model.path=nowhere/model", "data.train=nowhere/train.parquet")
    _fake_checkpoint(Path(cfg.checkpoint.dir), 2)
    _fake_checkpoint(Path(cfg.checkpoint.dir), 4)
    with caplog.at_level(logging.INFO, logger="sorl_megatron.trainer"):
        assert RLTrainer(cfg).run() == {}
    [line] = [r.getMessage() for r in caplog.records if r.name == "sorl_megatron.trainer"]
    assert line.startswith(f"run mine is finished: its checkpoint {Path(cfg.checkpoint.dir) / 'step_4'} is at step 4")
    assert not (tmp_path / "mine" / "servers").exists() and not (tmp_path / "mine" / "config.yaml").exists()


def test_a_run_with_steps_left_checks_its_inputs_before_it_announces_itself(tmp_path, caplog):
    """A bad input is the first and only line (the resume line follows good inputs: the
    e2e resume test sees it)."""
    from sorl_megatron.trainer.recipe.inputs import InputError

    cfg = _cfg(tmp_path, "data.train=nowhere/train.parquet")
    _fake_checkpoint(Path(cfg.checkpoint.dir), 2)
    with caplog.at_level(logging.INFO, logger="sorl_megatron.trainer"), pytest.raises(InputError, match="nowhere"):
        RLTrainer(cfg).run()
    assert not [r for r in caplog.records if r.name == "sorl_megatron.trainer"]


# ---------------------------------------------- what Ctrl-C says a rerun does (issue 32)


def _sft_cfg(tmp_path, *extra):
    return _cfg(tmp_path, "sft.enabled=true", "sft.steps=12", "sft.save_every=2", *extra)


def test_the_rerun_plan_follows_what_is_on_disk(tmp_path):
    from sorl_megatron.trainer.rerun import rerun_plan, sft_checkpoint_root, sft_model_dir

    cfg = _sft_cfg(tmp_path)
    assert rerun_plan(cfg) == "SFT restarts from step 0 (no SFT checkpoint yet, the first is at step 2), then RL"
    assert rerun_plan(_sft_cfg(tmp_path, "sft.save_every=0")) == (
        "SFT restarts from step 0 (sft.save_every=0 keeps no SFT checkpoint), then RL")
    _fake_checkpoint(sft_checkpoint_root(cfg), 2)
    _fake_checkpoint(sft_checkpoint_root(cfg), 4)
    (sft_checkpoint_root(cfg) / "step_6").mkdir()  # a save cut short: no manifest, not counted
    assert rerun_plan(cfg) == "SFT resumes from step 4 of 12, then RL"
    assert rerun_plan(_sft_cfg(tmp_path, "checkpoint.resume=none")) == (
        "SFT restarts from step 0 (checkpoint.resume=none), then RL")
    sft_model_dir(cfg).mkdir(parents=True)
    (sft_model_dir(cfg) / "SFT_DONE").write_text("{}")
    assert rerun_plan(cfg) == "RL starts from step 0 with the finished SFT policy (sft_model) (no RL checkpoint yet)"
    _fake_checkpoint(Path(cfg.checkpoint.dir), 2)
    assert rerun_plan(cfg) == "RL resumes from step 2 of 4"
    assert rerun_plan(_cfg(tmp_path, "sft.enabled=false", "checkpoint.resume=none")) == (
        "RL starts over from step 0 (checkpoint.resume=none)")
    _fake_checkpoint(Path(cfg.checkpoint.dir), 4)
    assert rerun_plan(cfg) == "nothing left to do, the run is finished (its RL checkpoint is at step 4)"


def test_ctrl_c_in_the_set_up_says_what_a_rerun_does(tmp_path, monkeypatch, capsys):
    """The trainer's interrupt carries its phase and plan; report_interrupt prints them in one line."""
    import signal

    import sorl_megatron.trainer.rl_loop as rl_loop
    from sorl_megatron.trainer.rerun import RunInterrupted, sft_checkpoint_root
    from sorl_megatron.trainer.serving.servers import SignalInterrupt, report_interrupt

    cfg = _sft_cfg(tmp_path)
    _fake_checkpoint(sft_checkpoint_root(cfg), 8)

    def stop(*args, **kwargs):
        raise SignalInterrupt(signal.SIGTERM)

    monkeypatch.setattr(rl_loop, "validate_inputs", stop)
    monkeypatch.setattr(rl_loop, "sft_resume_point", lambda cfg: None)  # the fake has no engine state to verify
    with pytest.raises(RunInterrupted) as err:
        RLTrainer(cfg).run()
    assert (err.value.signum, err.value.phase) == (signal.SIGTERM, "the set-up")
    monkeypatch.setenv("RANK", "0")
    assert report_interrupt(err.value) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == (
        "interrupted (SIGTERM) during the set-up: stopped the run and its servers; run the same command again: "
        "SFT resumes from step 8 of 12, then RL\n")
