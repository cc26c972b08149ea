"""An interrupted SFT cold start resumes exactly (issue 32): its checkpoints (engine, optimizer,
LR schedule, RNG; the data position is the step) every ``sft.save_every`` steps, the resumed
run's SFT loss curve and the SFT policy equal the uninterrupted run's, and Ctrl-C during SFT
names the step a rerun resumes from.

The runs stop when SFT is done (``build_engines``, RL's first act, is replaced by a stop), so
no rollout server is needed; one retrieval server serves the gold plans' searches.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sorl_megatron.engine.actor import PolicyEngine
from sorl_megatron.engine.checkpoint import complete_checkpoints
from sorl_megatron.trainer.rerun import RunInterrupted
from sorl_megatron.trainer.rl_loop import RLTrainer

from .e2e_helpers import (
    BASE_RECIPE,
    comparable,
    ctrl_c_train,
    make_tiny_data,
    read_metrics,
    run_overrides,
)

SFT = ["sft.enabled=true", "sft.batch_size=2", "schedule.total_steps=1", "rollout.max_turns=3",
       "rollout.max_turn_tokens=32", "rollout.max_total_tokens=420", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("sft_data"))


@pytest.fixture(scope="module")
def retrieval(tiny_data, tmp_path_factory):
    """One retrieval server for the module's runs (its key reaches them by environment variable)."""
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, retrieval_server_spec

    servers = EmbeddedServers(tmp_path_factory.mktemp("retrieval"))
    with pytest.MonkeyPatch.context() as env:
        try:
            url = servers.start(retrieval_server_spec(str(tiny_data / "corpus.jsonl"), 2))
            env.setenv("SORL_RETRIEVAL_API_KEY", servers.api_keys["retrieval"])
            yield [f"retrieval.url={url}"]
        finally:
            servers.stop()


class _SFTDone(Exception):
    """Raised where RL would build its engines: these tests are about SFT only."""


@pytest.fixture
def sft_only(monkeypatch):
    def stop(self, policy_path):
        raise _SFTDone(policy_path)

    monkeypatch.setattr(RLTrainer, "build_engines", stop)


def _interrupt_at_call(monkeypatch, n: int) -> None:
    """Ctrl-C as the ``n``-th SFT step starts (before it trains)."""
    calls = []
    original = PolicyEngine.sft_update

    def update(self, batch):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(PolicyEngine, "sft_update", update)


def _sft(overrides) -> None:
    from sorl_megatron.trainer.recipe.loader import load_recipe

    with pytest.raises(_SFTDone):
        RLTrainer(load_recipe(BASE_RECIPE, overrides)).run()


def _curve(run_dir: Path) -> dict[int, dict]:
    return {step: comparable(row) for step, row in read_metrics(run_dir / "sft").items()}


def test_interrupted_sft_resumes_to_the_uninterrupted_curve_and_weights(tiny_data, retrieval, sft_only, tmp_path,
                                                                      monkeypatch, caplog):
    """A: 12 steps without any SFT checkpoint. B: the same with one every 2 steps, Ctrl-C as step
    7 starts (checkpoints 4 and 6 kept: checkpoint.keep_last=2). C: B's command again resumes
    from step 6. C's loss curve (every logged number) and its SFT policy (every tensor) equal A's:
    saving neither draws random numbers nor changes the training."""
    from sorl_megatron.trainer.recipe.loader import load_recipe

    common = [*SFT, "sft.steps=12", *retrieval]
    _sft(run_overrides(tiny_data, tmp_path, "full", *common, "sft.save_every=0"))
    full = _curve(tmp_path / "full")
    assert sorted(full) == list(range(1, 13)) and full[12]["sft/nll"] < full[1]["sft/nll"]
    assert not (tmp_path / "full" / "ckpt" / "sft").exists()

    resumed = run_overrides(tiny_data, tmp_path, "resumed", *common, "sft.save_every=2")
    sft_root = tmp_path / "resumed" / "ckpt" / "sft"
    with monkeypatch.context() as patch:
        _interrupt_at_call(patch, 7)
        with pytest.raises(RunInterrupted) as err:
            RLTrainer(load_recipe(BASE_RECIPE, resumed)).run()
    assert err.value.phase == "SFT step 7 of 12"
    assert err.value.plan == "SFT resumes from step 6 of 12, then RL"
    assert [p.name for p in complete_checkpoints(sft_root)] == ["step_4", "step_6"]
    assert sorted(_curve(tmp_path / "resumed")) == list(range(1, 7))
    assert not (tmp_path / "resumed" / "sft_model" / "SFT_DONE").exists()

    with caplog.at_level(logging.INFO, logger="sorl_megatron.trainer"):
        _sft(resumed)
    assert f"SFT: resuming from step 6 of 12 ({sft_root / 'step_6'})" in caplog.messages
    assert _curve(tmp_path / "resumed") == full  # every step's loss, bit for bit
    a = load_file(tmp_path / "full" / "sft_model" / "model.safetensors")
    c = load_file(tmp_path / "resumed" / "sft_model" / "model.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert (tmp_path / "resumed" / "sft_model" / "SFT_DONE").is_file()
    assert not sft_root.exists()  # the SFT policy is written: its checkpoints are gone


def test_ctrl_c_during_sft_names_the_step_a_rerun_resumes_from(tiny_data, retrieval, sft_only, tmp_path,
                                                               monkeypatch, caplog):
    """The CLI in a subprocess, Ctrl-C (SIGINT to its process group) once an SFT checkpoint is
    complete: exit 130 and one line naming the newest complete checkpoint's step; the same
    command (here in process) resumes from it."""
    from sorl_megatron.trainer.recipe.loader import load_recipe

    args = run_overrides(tiny_data, tmp_path, "sigint", *SFT, "sft.steps=400", "sft.save_every=2",
                         "logging.progress=plain", *retrieval)
    sft_root = tmp_path / "sigint" / "ckpt" / "sft"
    run = ctrl_c_train(args, tmp_path, lambda: (sft_root / "step_2" / "MANIFEST.json").is_file(),
                       "its first SFT checkpoint")
    code, stderr = run.code, run.stderr
    assert not run.left, f"still alive after Ctrl-C: {run.left}"
    assert code == 130 and "Traceback" not in stderr, stderr[-4000:]
    line = stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"interrupted \(Ctrl-C\) during (SFT step \d+ of 400|the SFT checkpoint of step \d+): "
                         r"stopped the run and its servers; run the same command again: SFT resumes from step "
                         r"(\d+) of 400, then RL", line)
    assert match, line
    step = int(match.group(2))
    assert complete_checkpoints(sft_root)[-1].name == f"step_{step}"

    with monkeypatch.context() as patch, caplog.at_level(logging.INFO, logger="sorl_megatron.trainer"):
        _interrupt_at_call(patch, 1)  # the rerun stops as its first step starts
        with pytest.raises(RunInterrupted) as again:
            RLTrainer(load_recipe(BASE_RECIPE, args)).run()
    assert f"SFT: resuming from step {step} of 400 ({sft_root / f'step_{step}'})" in caplog.messages
    assert again.value.phase == f"SFT step {step + 1} of 400"
    assert sorted(_curve(tmp_path / "sigint")) == list(range(1, step + 1))  # the log continues at the checkpoint
