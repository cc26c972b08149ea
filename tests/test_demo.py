import pytest

from sorl_megatron import toy_demo as demo


def test_demo_training_improves_reward_with_stabilized_losses():
    task = demo.ToyTask()
    for name, estimator in [("so_ppo", "gae"), ("so_grpo", "grpo"), ("grpo", "pvpo")]:
        summary = demo.train(name, estimator, task, steps=10, delta=1e-3)
        assert summary["reward_end"] > summary["reward_start"] + 0.15, (name, summary)


def test_demo_cli_runs_and_rejects_unknown_names(capsys):
    assert demo.main(["--steps", "1", "--runs", "sapo,gspo"]) == 0
    out = capsys.readouterr().out
    assert "sapo      grpo" in out and "gspo      grpo" in out
    with pytest.raises(SystemExit):
        demo.main(["--runs", "ppo3"])
    assert "unknown loss 'ppo3'" in capsys.readouterr().err


def test_the_cpu_demo_started_elsewhere_says_where_it_builds(tmp_path, monkeypatch):
    """Issue 48: tools/demo.py run from another directory, while the repository holds the demo's
    data, says that it builds a second data set there instead of doing so silently."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_demo_cli", root / "tools" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fake_root = tmp_path / "repo"
    (fake_root / "runs" / "tiny" / "model").mkdir(parents=True)
    (fake_root / "runs" / "tiny" / "model" / "config.json").write_text("{}")
    monkeypatch.setattr(module, "ROOT", fake_root)
    monkeypatch.chdir(fake_root)
    assert module.elsewhere_note(Path("runs/tiny")) == ""  # in the repository: nothing to say
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    note = module.elsewhere_note(Path("runs/tiny"))
    assert f"relative to the working directory {tmp_path / 'other'}, not to the repository" in note
    assert f"run it from {fake_root}" in note
    assert module.elsewhere_note(tmp_path / "abs") == ""  # an absolute --data means what it says
