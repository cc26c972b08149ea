"""``checkpoint.resume=none`` starts a run over without overwriting the previous one (issue 48):
its metrics, TensorBoard events, plots and checkpoints move to ``previous/<k>/``, a finished SFT
policy stays for RL to start from again."""

from __future__ import annotations

from pathlib import Path

from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.rerun import SFT_DONE, set_aside_previous_run

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, *extra):
    return load_recipe(ROOT / "recipes" / "tiny_search_so_grpo.yaml",
                       [f"logging.dir={tmp_path}", "logging.run_name=r", "checkpoint.resume=none", *extra])


def _previous_run(cfg, sft_done: bool) -> tuple[Path, Path]:
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    ckpt = Path(cfg.checkpoint.dir)
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (ckpt / "step_4").mkdir(parents=True)
    (ckpt / "step_4" / "trainer.json").write_text("{}")
    (ckpt / "sft" / "step_200").mkdir(parents=True)
    (ckpt / "run.lock").write_text("held")
    (run_dir / "sft_model").mkdir()
    if sft_done:
        (run_dir / "sft_model" / SFT_DONE).write_text("")
    return run_dir, ckpt


def test_a_start_over_moves_the_previous_run_aside(tmp_path):
    cfg = _cfg(tmp_path)
    run_dir, ckpt = _previous_run(cfg, sft_done=False)
    aside = set_aside_previous_run(cfg)
    assert aside == run_dir / "previous" / "1"
    assert (aside / "metrics.jsonl").read_text() == '{"step": 0}\n' and (aside / "tensorboard").is_dir()
    assert (ckpt / "previous" / "1" / "step_4" / "trainer.json").is_file()
    assert (ckpt / "previous" / "1" / "sft" / "step_200").is_dir()  # SFT had not finished: it starts over too
    assert not (run_dir / "metrics.jsonl").exists() and not (ckpt / "step_4").exists()
    assert (ckpt / "run.lock").read_text() == "held"  # the lock, held by this run, stays where it is
    assert set_aside_previous_run(cfg) is None  # nothing left to move


def test_a_finished_sft_policy_stays_and_a_second_start_over_gets_its_own_place(tmp_path):
    cfg = _cfg(tmp_path)
    run_dir, ckpt = _previous_run(cfg, sft_done=True)
    assert set_aside_previous_run(cfg) == run_dir / "previous" / "1"
    assert (run_dir / "sft_model" / SFT_DONE).is_file()
    assert (ckpt / "sft").is_dir()  # kept with the finished SFT (they are removed when SFT writes its policy)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert set_aside_previous_run(cfg) == run_dir / "previous" / "2"
    assert (run_dir / "previous" / "2" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (run_dir / "previous" / "1" / "metrics.jsonl").read_text() == '{"step": 0}\n'
