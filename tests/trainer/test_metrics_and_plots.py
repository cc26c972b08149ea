import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sorl_megatron.trainer.metrics.logger import MetricsLogger, read_metrics
from sorl_megatron.trainer.metrics.plots import plot_runs

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
    code = ("import logging\nfrom sorl_megatron.trainer.metrics.logger import show_trainer_log\n"
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


def _captured_figures(monkeypatch) -> dict:
    """Figures by file name, caught as plot_runs saves them."""
    from matplotlib.figure import Figure

    figures, save = {}, Figure.savefig

    def capture(fig, path, *args, **kwargs):
        figures[Path(path).name] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", capture)
    return figures


def _demo_like_run(path, em=(0.40, 0.42, 0.45), mismatch=1e-7):
    """A run directory as the trainer leaves it: config.yaml, RL metrics, the SFT stage's."""
    from sorl_megatron.trainer.recipe.loader import dump_config, load_recipe

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(dump_config(load_recipe(ROOT / "recipes" / "tiny_search_so_grpo.yaml")))
    sft = MetricsLogger(path / "sft", total_steps=40, tensorboard=False, progress="none", name="sft")
    for step in range(1, 41):
        sft.log(step, {"sft/nll": 3.0 / step})
    sft.close()
    log = MetricsLogger(path, total_steps=len(em) - 1, tensorboard=False, progress="none")
    for step, value in enumerate(em):
        log.log(step, {"val/em": value, "rollout/reward": value, "actor/is/mismatch_abs_mean": mismatch * (1 + step)})
    log.close()


def test_plot_axes_fit_their_metrics(tmp_path, monkeypatch):
    """EM and rates on [0, 1], whole-step ticks, labelled axes, 1e-7 noise drawn flat, the SFT
    curve against SFT steps, and the run with its recipe in the summary's title."""
    figures = _captured_figures(monkeypatch)
    _demo_like_run(tmp_path / "so_grpo")
    written = plot_runs([tmp_path / "so_grpo"], tmp_path / "plots")
    assert {p.name for p in written} == {"val_em.png", "rollout_reward.png", "actor_is_mismatch_abs_mean.png",
                                         "sft_nll.png", "summary.png"}
    em = figures["val_em.png"].axes[0]
    low, high = em.get_ylim()
    assert low <= 0 and 1 <= high < 1.1  # an EM change of 0.05 does not fill the panel
    assert em.get_ylabel() == "exact match (fraction of questions)" and em.get_xlabel() == "RL step"
    assert all(float(t).is_integer() for t in em.get_xticks())  # no step 0.5
    mismatch = figures["actor_is_mismatch_abs_mean.png"].axes[0]
    assert mismatch.get_ylim()[1] >= 1e-3 and mismatch.get_ylim()[0] <= 0  # noise of 1e-7 stays flat
    sft = figures["sft_nll.png"].axes[0]
    assert sft.get_xlabel() == "SFT step" and sft.get_lines()[0].get_xdata()[-1] == 40
    title = figures["summary.png"]._suptitle.get_text()
    assert title == "run so_grpo: so_grpo with grpo advantages; 8 prompts x 8, mini-batch 32, lr 0.0003, seed 1234"


def test_an_all_zero_non_negative_metric_sits_at_the_bottom():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sorl_megatron.trainer.metrics.plots import style_axis

    fig, ax = plt.subplots()
    ax.plot([1, 2], [0.0, 0.0])
    style_axis(ax, "actor/grad_norm", [0.0, 0.0])
    low, high = ax.get_ylim()
    assert -0.1 < low <= 0 and high >= 1
    # a flat line on an axis of its own scale would hide that it is exactly constant: the panel says so
    assert [t.get_text() for t in ax.texts] == ["0 at every step"]
    plt.close(fig)
    fig, ax = plt.subplots()
    style_axis(ax, "actor/grad_norm", [0.0, 0.5])
    assert len(ax.texts) == 0
    plt.close(fig)


def test_plot_smoothing_and_overlays(tmp_path, monkeypatch):
    figures = _captured_figures(monkeypatch)
    _demo_like_run(tmp_path / "a", em=(0.2, 0.6, 0.4))
    _demo_like_run(tmp_path / "b", em=(0.3, 0.3, 0.3))
    plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "plots", smooth=0.5)
    em = figures["val_em.png"].axes[0]
    lines = em.get_lines()
    assert len(lines) == 4  # per run: the raw curve, faint, and its smoothing
    raw, smoothed = lines[0].get_ydata(), lines[1].get_ydata()
    assert list(raw) == [0.2, 0.6, 0.4] and smoothed[0] == pytest.approx(0.2) and smoothed[1] < 0.6
    assert [t.get_text() for t in em.get_legend().get_texts()] == ["a", "b"]
    assert figures["summary.png"]._suptitle.get_text() == "runs a, b (smoothed, weight 0.5)"


def test_smooth_ema():
    from sorl_megatron.trainer.metrics.plots import smooth_ema

    assert smooth_ema([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    assert smooth_ema([5.0, 5.0, 5.0], 0.9) == pytest.approx([5.0, 5.0, 5.0])  # debiased: no pull to 0
    assert smooth_ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
    with pytest.raises(ValueError, match=r"smoothing weight must be in \[0, 1\)"):
        smooth_ema([1.0], 1.0)


def test_plot_cli_smooth_flag(tmp_path):
    _demo_like_run(tmp_path / "a")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot.py"), str(tmp_path / "a"), "--out",
                           str(tmp_path / "p"), "--smooth", "0.6"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "summary.png" in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot.py"), str(tmp_path / "a"), "--out",
                           str(tmp_path / "p"), "--smooth", "1", "--overwrite"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "argument --smooth: must be in [0, 0.999], got 1" in proc.stderr


def test_plot_cli_refuses_to_overwrite_an_earlier_plot(tmp_path):
    """Issue 48: a second plot into the same --out replaced the first without a word."""
    _demo_like_run(tmp_path / "a")
    cmd = [sys.executable, str(ROOT / "tools" / "plot.py"), str(tmp_path / "a"), "--out", str(tmp_path / "p")]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
    before = (tmp_path / "p" / "summary.png").stat().st_mtime_ns
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"error: --out {tmp_path / 'p'} already holds" in proc.stderr and "pass --overwrite" in proc.stderr
    assert (tmp_path / "p" / "summary.png").stat().st_mtime_ns == before  # untouched
    proc = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "summary.png" in proc.stdout, proc.stderr


def test_axes_tick_the_validation_steps_and_scale_to_small_and_spread_values():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sorl_megatron.trainer.metrics.plots import style_axis

    fig, (em, clip, kl) = plt.subplots(1, 3)
    style_axis(em, "val/em", [0.4, 0.5], steps=[0, 4, 8, 12])
    assert list(em.get_xticks()) == [0, 4, 8, 12]
    clip.plot([1, 2, 3], [0.001, 0.008, 0.004])
    style_axis(clip, "actor/clip_frac", [0.001, 0.008, 0.004], steps=[1, 2, 3])
    assert clip.get_ylim()[0] <= 0 and 0.008 < clip.get_ylim()[1] < 0.01  # the data fills the panel, not [0, 1]
    kl.plot([1, 2], [1e-3, 2.0])
    style_axis(kl, "actor/approx_kl_k3", [1e-3, 2.0], steps=list(range(1, 30)))
    assert kl.get_yscale() == "log" and kl.get_ylabel().endswith("(log)")
    assert all(float(t).is_integer() for t in kl.get_xticks())
    plt.close(fig)


def test_overlaid_runs_name_identical_curves_keep_legends_outside_and_explain_symbols(tmp_path, monkeypatch):
    figures = _captured_figures(monkeypatch)
    _demo_like_run(tmp_path / "a", em=(0.2, 0.6, 0.4))
    _demo_like_run(tmp_path / "b", em=(0.2, 0.6, 0.4))
    _demo_like_run(tmp_path / "c", em=(0.3, 0.3, 0.3))
    plot_runs([tmp_path / "a", tmp_path / "b", tmp_path / "c"], tmp_path / "plots")
    em = figures["val_em.png"].axes[0]
    assert em.get_title() == "validation exact match\nidentical curves: b = a"
    styles = [(line.get_linestyle(), line.get_marker()) for line in em.get_lines()]
    assert len(set(styles)) == 3  # told apart without colour, and b drawn over a stays visible
    legend = em.get_legend()
    assert legend.get_bbox_to_anchor().x0 > em.get_window_extent().x1  # beside the panel
    summary = figures["summary.png"]
    assert summary.legends and all(ax.get_legend() is None for ax in summary.axes)
    notes = " ".join(t.get_text() for t in figures["actor_is_mismatch_abs_mean.png"].texts)
    assert "pi_old: the policy that sampled the batch" in notes and "mu: the rollout engine's" in notes


def test_gpu_memory_metrics_are_the_allocator_peaks_and_restart_them(monkeypatch):
    # Mocked: there is no GPU here. The trainer logs CUDA's peaks per step (docs/how-to/gpu-check.md compares
    # them with the memory plan on an H100); without CUDA it logs nothing.
    import torch

    from sorl_megatron.trainer.rl_loop import gpu_memory_metrics

    assert gpu_memory_metrics() == {}
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2**31)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(1))
    assert gpu_memory_metrics() == {"memory/peak_allocated_gib": 1.5, "memory/peak_reserved_gib": 2.0}
    assert resets == [1]
