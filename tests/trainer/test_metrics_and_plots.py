import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sorl_megatron.trainer.metrics_log import MetricsLogger, read_metrics
from sorl_megatron.trainer.plots import plot_runs

ROOT = Path(__file__).resolve().parents[2]


def _fake_run(path, scale):
    log = MetricsLogger(path, total_steps=4, tensorboard=True, progress="none")
    for step in range(1, 5):
        log.log(step, {"rollout/reward": scale * step, "actor/clip_frac": torch.tensor(0.01 * step),
                       "actor/clip_bias/norm": float("nan"), "note": "text is skipped"})
    log.close()


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
    _fake_run(tmp_path / "a", 0.1)
    rows = read_metrics(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["rollout/reward"] == pytest.approx(0.2) and rows[1]["actor/clip_frac"] == pytest.approx(0.02)
    assert rows[0]["actor/clip_bias/norm"] is None and "note" not in rows[0]
    assert any((tmp_path / "a" / "tensorboard").iterdir())
    # resuming from step 2 drops the rows logged after the checkpoint
    log = MetricsLogger(tmp_path / "a", total_steps=4, tensorboard=False, progress="none", start_step=2)
    log.log(3, {"rollout/reward": 9.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "a")] == [1, 2, 3]


def test_logger_writes_a_tensorboard_histogram(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator

    from sorl_megatron.algorithms.diagnostics import abs_log_ratio_histogram

    lr = torch.tensor([[0.0, 0.01, 0.5, 150.0], [0.02, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    hist = abs_log_ratio_histogram(lr, torch.zeros(2, 4), mask)
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=True, progress="none")
    log.log_histogram(3, "actor/abs_log_ratio", hist)
    log.log_histogram(4, "actor/abs_log_ratio", abs_log_ratio_histogram(lr, lr, 0 * mask))  # empty: skipped
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={HISTOGRAMS: 0})
    acc.Reload()
    (event,) = acc.Histograms("actor/abs_log_ratio")
    h = event.histogram_value
    assert event.step == 3 and h.num == 6 and h.max == pytest.approx(150.0) and h.min == 0.0
    assert sum(h.bucket) == 6 and h.bucket[0] == 1 and h.bucket[-1] == 1  # [0, 1e-8) and [1e2, max]
    assert h.bucket_limit[-1] == pytest.approx(150.0) and h.sum == pytest.approx(153.53, rel=1e-6)


def test_a_torn_last_line_is_dropped_on_read_and_resume(tmp_path):
    # a run killed in the middle of an append leaves half a line without its newline
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress="none", start_step=2)
    log.log(3, {"x": 3.0})
    log.close()
    assert [(r["step"], r["x"]) for r in read_metrics(path)] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    # a bad line anywhere else is corruption, not a torn write: an error naming the line
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress="none", start_step=2)


def test_plots_overlay_runs(tmp_path):
    _fake_run(tmp_path / "a", 0.1)
    _fake_run(tmp_path / "b", 0.2)
    written = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "plots")
    names = {p.name for p in written}
    assert {"rollout_reward.png", "actor_clip_frac.png", "summary.png"} <= names
    assert "actor_clip_bias_norm.png" not in names  # only nulls were logged
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_plot_cli_errors_clearly(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot.py"), str(tmp_path / "missing"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "no metrics file" in proc.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot.py"), str(tmp_path / "bad"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "metrics.jsonl:2" in proc.stderr


def test_entry_points_show_the_trainer_log_once(tmp_path):
    # a fresh interpreter: the handler is process-global
    code = ("import logging\nfrom sorl_megatron.trainer.metrics_log import show_trainer_log\n"
            "logging.getLogger('sorl_megatron.trainer').info('hidden')\n"
            "show_trainer_log(); show_trainer_log()\n"
            "logging.getLogger('sorl_megatron.trainer').info('PVPO: 3 prompts kept')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("PVPO: 3 prompts kept") == 1 and "hidden" not in proc.stderr


def test_tokens_per_second_per_pass():
    from sorl_megatron.trainer.rl_loop import tokens_per_second

    times = {"time/actor_update": 2.0, "time/old_logprobs": 0.5, "time/values": 0.0}
    got = tokens_per_second(times, {"actor_update": 1000.0, "old_logprobs": 1000.0, "values": 10.0,
                                    "critic_update": 5.0, "ref_logprobs": None})
    assert got == {"time/actor_update_tokens_per_s": 500.0, "time/old_logprobs_tokens_per_s": 2000.0}
