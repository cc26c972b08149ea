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
