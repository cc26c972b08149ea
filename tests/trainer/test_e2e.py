"""End-to-end trainer runs: real Megatron engines, real rollout and retrieval servers.

One synthetic data set and tiny Qwen3-MoE (vocabulary 520, so TP=2 can shard it) are
generated once for the module. Most runs happen in this pytest process (megatron's import
and the rollout server's start-up are the fixed costs): the loss loop, the layout and resume
references and the PVPO run talk to one pair of servers started here (the trainer's
external-URL path, which syncs the trainer's weights to the server when a run starts), while
the failure, resume-after-kill and layout runs start their own embedded servers.

What is crafted (a random tiny model never answers a question right, so exact match is 0
everywhere): ``LengthReward`` scores a response by its length, so GRPO groups have variance
and every loss gets a non-zero gradient; the PVPO test gives three prompts rewards that make
them always solved / never solved / solved half the time.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sorl_megatron.rewards.registry import RewardRegistry

from .e2e_helpers import (
    BASE_RECIPE,
    ROOT,
    VENV_BIN,
    abs_tol,
    assert_finite,
    children,
    comparable,
    ctrl_c_train,
    make_tiny_data,
    read_metrics,
    run_overrides,
    server_children,
    shared_embedded_servers,
    subprocess_env,
    wait_dead,
)

# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    out = make_tiny_data(tmp_path_factory.mktemp("e2e_data"))
    assert json.loads((out / "model" / "config.json").read_text())["vocab_size"] % 2 == 0
    return out


@pytest.fixture(scope="module")
def shared_servers(tiny_data, tmp_path_factory):
    """One rollout server (routed experts enabled, for R3 runs) and one retrieval server."""
    with shared_embedded_servers(tiny_data, tmp_path_factory.mktemp("shared_servers")) as servers:
        yield servers["overrides"]


class LengthReward(RewardRegistry):
    """Crafted reward in {0, .25, .5, .75, 1}: the response length mod 5 (see module doc)."""

    def score(self, data_source, response, ground_truth):
        text = response if isinstance(response, str) else "".join(response)  # the policy's turns
        return (len(text) % 5) / 4


@pytest.fixture
def length_reward(monkeypatch):
    monkeypatch.setattr("sorl_megatron.trainer.rl_loop.RewardRegistry", LengthReward)


def _trainer(overrides, cls=None):
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.rl_loop import RLTrainer

    return (cls or RLTrainer)(load_recipe(BASE_RECIPE, overrides))


@pytest.fixture
def server_spy(monkeypatch):
    """Records every embedded server process the trainer starts."""
    from sorl_megatron.trainer.serving.servers import EmbeddedServers

    started: list[subprocess.Popen] = []
    original = EmbeddedServers.launch  # every start (and restart) launches

    def launch(self, spec):
        try:
            return original(self, spec)
        finally:
            started.append(self.procs.get(spec.name))

    monkeypatch.setattr(EmbeddedServers, "launch", launch)
    return started


def _assert_reaped(procs):
    assert procs and all(p is not None for p in procs)
    for p in procs:
        assert p.poll() is not None, f"server {p.args} still running"
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


# ------------------------------------------------------------------- 1. every loss trains

LOSS_RUNS = [  # (loss, advantage estimator, extra overrides riding along)
    ("ppo", "gae", ["optimizer.warmup_steps=3", "optimizer.critic_warmup_steps=0"]),
    ("turn_ppo", "gae", []),
    ("s_ppo", "gae", ["schedule.ppo_epochs=2"]),
    ("so_ppo", "gae", ["algorithm.loss.clip_bias.mode=scalar"]),
    ("grpo", "grpo", []),
    ("so_grpo", "grpo", ["algorithm.routing_replay=r2"]),
    ("gspo", "grpo", ["algorithm.routing_replay=r3"]),
    ("gspo_token", "grpo", ["algorithm.loss.clip_bias.diagnostics=true"]),
    ("sapo", "grpo", ["algorithm.loss.kl_coef=0.01", "reward.metric=f1"]),
    ("cispo", "grpo", ["algorithm.loss.eps_low=0.999", "algorithm.loss.eps_high=0.28"]),
    ("grpo", "pvpo", ["algorithm.pvpo.num_ref_rollouts=2"]),
]


def test_every_loss_trains(tiny_data, shared_servers, length_reward, tmp_path):
    """Each loss name runs one RL step in this process with fresh engines (megatron's
    parallel state re-initialized per run) against the shared servers."""
    from sorl_megatron.algorithms import POLICY_LOSSES

    assert {loss for loss, _, _ in LOSS_RUNS} == set(POLICY_LOSSES)
    failures = []
    for loss, estimator, extra in LOSS_RUNS:
        name = f"{loss}_{estimator}"
        trainer = _trainer(run_overrides(tiny_data, tmp_path, name, f"algorithm.loss.name={loss}",
                                         f"algorithm.advantage.estimator={estimator}", "schedule.total_steps=1",
                                         *shared_servers, *extra))
        try:
            last = trainer.run()
        except Exception as err:  # report every failing loss, not just the first
            failures.append(f"{name}: {type(err).__name__}: {err}")
            continue
        m = read_metrics(tmp_path / name)[1]
        assert comparable(last) == comparable(m)
        assert_finite(m, name)
        steps = 2 * (2 if "schedule.ppo_epochs=2" in extra else 1)  # 4 trajectories / mini-batch 2 (x epochs)
        assert m["actor/steps"] == steps, name
        assert m["rollout/policy_tokens"] > 0 and m["actor/policy_tokens"] > 0, name
        assert m["actor/grad_norm"] > 0, name  # non-zero advantages reached the weights
        has_critic = any(k.startswith("critic/") for k in m)
        assert has_critic == (estimator == "gae"), (name, sorted(k for k in m if k.startswith("critic/")))
        if has_critic:
            assert m["critic/steps"] == 2 and m["critic/grad_norm"] > 0, name
        if "kl_coef" in " ".join(extra):
            assert "time/ref_logprobs" in m and m["actor/kl_ref"] >= 0, name
        # the SORL figures' diagnostics reach the run's log (ranges only: values are tested in tests/engine)
        assert 0 <= m["rollout/valid_action_ratio"] <= 1 and m["actor/advantage/var"] >= 0, name
        assert 0 <= m["actor/abs_log_ratio/p50"] <= m["actor/abs_log_ratio/max"], name
        assert ("actor/clip_bias/param_norm" in m) == ("algorithm.loss.clip_bias.diagnostics=true" in extra), name
        if "routing_replay" in " ".join(extra):
            assert m["actor/routing/replayed_pairs"] > 0, name
        if "algorithm.routing_replay=r3" in extra:  # the old pass replays the rollout engine's routes
            assert m["old/routing/replayed_pairs"] > 0 and 0 <= m["old/routing/replay_mismatch_frac"] <= 1, name
        if "reward.metric=f1" in extra:
            assert trainer.rewards.metric_override == "f1", name
        if "optimizer.critic_warmup_steps=0" in extra:
            assert (trainer.actor.scheduler.lr_warmup_steps, trainer.critic.scheduler.lr_warmup_steps) == (3, 0), name
        if estimator == "pvpo":
            assert trainer.pvpo is not None and set(trainer.stream.indices) <= set(trainer.pvpo.state.accuracy)
        assert (tmp_path / name / "ckpt" / "step_1" / "trainer.json").is_file(), name
        assert m["time/checkpoint"] > 0 and m["time/weight_sync"] > 0, name
        assert not (tmp_path / name / "servers").exists(), f"{name} started embedded servers despite URLs"
    assert not failures, "\n".join(failures)


def test_old_logprobs_from_the_update_leave_every_number(tiny_data, shared_servers, length_reward, tmp_path):
    """``schedule.old_logprobs_from_update`` (the default): the old pass skips the update's first
    mini-batch, whose forward gives those rows' old log-probs; on PPO with a critic every logged
    number is the same as with the full old pass, but the old pass's token count (and what the
    shared server's log-probs move run to run). PVPO's test checks its ground-truth rows."""
    for loss, estimator, extra in LOSS_RUNS[:1]:
        rows = {}
        for flag in ("true", "false"):
            name = f"{loss}_{estimator}_{flag}"
            _trainer(run_overrides(tiny_data, tmp_path, name, f"algorithm.loss.name={loss}",
                                   f"algorithm.advantage.estimator={estimator}", "schedule.total_steps=2",
                                   f"schedule.old_logprobs_from_update={flag}", *shared_servers, *extra)).run()
            rows[flag] = read_metrics(tmp_path / name)
        for step in (1, 2):
            on, off = comparable(rows["true"][step]), comparable(rows["false"][step])
            assert on["old/batching/tokens"] < off["old/batching/tokens"], (loss, step)
            # and the train/inference mismatch: the shared server (not in deterministic mode) gives the
            # same tokens in every run, their log-probs to the last bits only in the batch they meet
            skip = {k for k in off if k.startswith(("old/batching/", "mismatch/", "actor/is/mismatch_"))}
            assert {k: v for k, v in on.items() if k not in skip} == {k: v for k, v in off.items() if k not in skip}


# ---------------------------------------------------------- 2. layouts equal world size 1

LAYOUT_KEYS = ["rollout/reward", "rollout/policy_tokens", "actor/loss", "actor/pg_loss", "actor/clip_frac",
               "actor/grad_norm", "actor/clip_bias/norm", "actor/ratio/mean", "actor/approx_kl_k3",
               "critic/value_loss", "critic/grad_norm", "critic/values/mean"]
LAYOUTS = {"tp2": "parallelism.tp=2", "ep2": "parallelism.ep=2", "pp2": "parallelism.pp=2"}


def test_layouts_match_world_size_1(tiny_data, shared_servers, tmp_path):
    """TP=2 (+SP), EP=2 (with DP=2) and PP=2 give world size 1's first-step metrics.

    One ``torchrun --nproc_per_node=2`` calls the CLI's ``main`` once per layout (fresh engines,
    megatron's groups re-initialized at each layout on the same world); all runs use the shared
    servers, whose weights each run resets to the initial checkpoint, so every layout sees the
    same rollouts (sampling is seeded per request) and only the Megatron side differs."""
    from sorl_megatron.train import main

    common = [
        "algorithm.loss.name=so_ppo",
        "algorithm.advantage.estimator=gae",
        "schedule.total_steps=1",
        "schedule.ppo_epochs=2",
        *shared_servers,
    ]
    assert main(["--config", BASE_RECIPE, *run_overrides(tiny_data, tmp_path, "ws1", *common)]) == 0

    spec = tmp_path / "launch.json"
    runs = [
        ["--config", BASE_RECIPE, *run_overrides(tiny_data, tmp_path, name, *common, layout)]
        for name, layout in LAYOUTS.items()
    ]
    # riding along in the same torchrun, first (before any run has made the process group): the
    # SFT stage at TP2 with the embedded retrieval server. Rank 0 alone starts it and plays the
    # gold plans; rank 1 gets them by broadcast.
    rollout_url = [o for o in shared_servers if o.startswith("rollout.urls=")]
    runs.insert(
        0,
        [
            "--config",
            BASE_RECIPE,
            *run_overrides(
                tiny_data,
                tmp_path,
                "sft_tp2",
                "parallelism.tp=2",
                "sft.enabled=true",
                "sft.steps=2",
                "sft.batch_size=2",
                "schedule.total_steps=1",
                *rollout_url,
                "rollout.max_turns=3",
                "rollout.max_turn_tokens=32",
                "rollout.max_total_tokens=420",
            ),
        ],
    )
    # and last, riding along too: an async run at TP2 (rank 0's producer generates across the
    # weight syncs every rank joins; the batch is broadcast), 2 steps
    runs.append(["--config", BASE_RECIPE, *run_overrides(
        tiny_data, tmp_path, "async_tp2", "parallelism.tp=2", "rollout.mode=async", "schedule.total_steps=2",
        "algorithm.loss.name=grpo", "algorithm.advantage.estimator=grpo", "algorithm.loss.is_correction.mode=tis",
        *shared_servers)])
    spec.write_text(json.dumps(runs))
    cmd = [os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "e2e_launch.py"), str(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    ref = read_metrics(tmp_path / "ws1")[1]
    assert ref["actor/grad_norm"] > 0 and ref["critic/grad_norm"] > 0 and ref["rollout/policy_tokens"] > 0
    assert ref["actor/clip_frac"] > 0 and ref["actor/clip_bias/norm"] > 0  # the off-policy mini-batches clip
    for name in LAYOUTS:
        got = read_metrics(tmp_path / name)[1]
        assert_finite(got, name)
        for key in LAYOUT_KEYS:
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key, got[key], ref[key])

    async_run = read_metrics(tmp_path / "async_tp2")
    assert sorted(async_run) == [0, 1, 2]
    for step in (1, 2):
        assert_finite(async_run[step], f"async_tp2 step {step}")
        assert async_run[step]["rollout/version_lag_max"] <= 1 and async_run[step]["rollout/policy_tokens"] > 0
    episodes = [json.loads(x) for x in (tmp_path / "async_tp2" / "episodes.jsonl").read_text().splitlines()]
    assert [sum(r["step"] == s and r["status"] == "trained" for r in episodes) for s in (1, 2)] == [2, 2]

    sft_run = tmp_path / "sft_tp2"
    assert (sft_run / "sft_model" / "SFT_DONE").is_file() and sorted(read_metrics(sft_run / "sft")) == [1, 2]
    assert_finite(read_metrics(sft_run)[1], "sft_tp2")
    retrieval_log = (sft_run / "servers" / "retrieval.log").read_text()
    assert retrieval_log.count("indexed ") == 1, retrieval_log  # one embedded retrieval server, rank 0's


# ------------------------------------------------------------- 3. resume after a SIGKILL


@pytest.fixture
def one_thread():
    """The CLI subprocess runs with OMP_NUM_THREADS=1; in-process runs compared with it must
    reduce in the same order (one thread) to agree to the last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_resume_after_kill_equals_uninterrupted(tiny_data, shared_servers, server_spy, tmp_path, one_thread, caplog):
    """Run A: 3 steps uninterrupted (in process). Run B: the CLI in a subprocess, SIGKILLed
    once its step-2 checkpoint is complete (its servers must die with it); a half-written
    ``step_3.tmp`` is left behind as a kill mid-save would. Run C: the same command resumed
    (``checkpoint.resume=auto``, embedded servers) takes step 3. B's steps 1-2 and C's step 3
    equal A's."""
    common = ["algorithm.loss.name=so_ppo", "algorithm.advantage.estimator=gae", "schedule.total_steps=3",
              "checkpoint.save_every=1", "checkpoint.keep_last=3"]
    _trainer(run_overrides(tiny_data, tmp_path, "full", *common, *shared_servers)).run()
    full = read_metrics(tmp_path / "full")

    killed = run_overrides(tiny_data, tmp_path, "killed", *common)
    ckpt = tmp_path / "killed" / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sorl_megatron.train", "--config", BASE_RECIPE, *killed],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / "step_2" / "trainer.json").is_file():
            assert proc.poll() is None, f"run B exited early:\n{proc.stdout.read().decode()[-4000:]}"
            assert time.monotonic() < deadline, "run B did not reach its step-2 checkpoint"
            servers = server_children(proc.pid) or servers
            time.sleep(0.05)
        servers = server_children(proc.pid) or servers
        helpers = children(proc.pid)  # the servers and e.g. the checkpoint writer's manager process
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert len(servers) == 2, f"expected the 2 embedded servers as children of run B, got {servers}"
    left = wait_dead(servers, timeout_s=30)
    for pid in left:  # do not leak them even when the assertion below fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"embedded servers {left} outlived the SIGKILLed trainer"
    left = wait_dead(helpers, timeout_s=30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"child processes {left} of the SIGKILLed trainer outlived it"
    assert not (ckpt / "step_3" / "trainer.json").exists(), "run B finished step 3 before the kill"
    partial = ckpt / "step_3.tmp"
    partial.mkdir(exist_ok=True)
    (partial / "trainer.json").write_text("{}")  # a kill between writing trainer.json and the rename

    trainer = _trainer(killed)
    restored = []
    original_restore = trainer.restore
    trainer.restore = lambda path: restored.append(original_restore(path)) or restored[-1]
    with caplog.at_level(logging.INFO, logger="sorl_megatron.trainer"):
        trainer.run()
        assert restored == [2]
        assert f"resuming run killed from step 2 of 3 ({ckpt / 'step_2'})" in caplog.messages
        caplog.clear()
        assert _trainer(killed).run() == {}  # the same command once more: finished, says so, does nothing
        assert caplog.messages[0].startswith(f"run killed is finished: its checkpoint {ckpt / 'step_3'} is at step 3")
    _assert_reaped(server_spy)  # C's embedded servers stopped on normal exit

    resumed = read_metrics(tmp_path / "killed")
    assert sorted(resumed) == sorted(full) == [0, 1, 2, 3]  # step 0: the (here empty) initial validation
    for step in (1, 2, 3):
        a, b = comparable(full[step]), comparable(resumed[step])
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        diff = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=abs_tol(k))}
        assert not diff, f"step {step} differs from the uninterrupted run: {diff}"
    assert full[3]["actor/grad_norm"] > 0 and full[3]["critic/grad_norm"] > 0
    assert full[3]["actor/pg_loss"] != full[2]["actor/pg_loss"]  # the steps are not all the same


def test_ctrl_c_stops_the_run_and_its_servers_with_one_line(tiny_data, tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the launch's whole process group) once the run
    trains: exit code 130, one line saying what happened and how to resume, no traceback, and
    the embedded servers and every other child process gone."""
    args = run_overrides(tiny_data, tmp_path, "interrupted", "schedule.total_steps=50", "logging.progress=plain")
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    # steps 0 and 1 logged
    run = ctrl_c_train(args, tmp_path, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2,
                       "step 1")
    code, stdout, stderr, servers, left = run.code, run.stdout, run.stderr, run.servers, run.left
    assert len(servers) == 2 and not left, f"servers {servers}; still alive after Ctrl-C: {left}"
    assert code == 130, stderr[-4000:]
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr, stderr[-4000:]
    # what a rerun does, as the disk has it: no RL checkpoint yet (the first is at step 4), or the newest one
    line = stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"interrupted \(Ctrl-C\) during (.+): stopped the run and its servers; run the same "
                         r"command again: RL (starts from step 0 \(no RL checkpoint yet\)|resumes from step (\d+) "
                         r"of 50)", line)
    assert match and re.fullmatch(r"RL step \d+ of 50|the (checkpoint|validation) after RL step \d+|the checkpoint "
                                  r"of RL step \d+", match.group(1)), line
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "interrupted" / "ckpt").glob("step_*") if p.name[5:].isdigit()
                   and (p / "MANIFEST.json").is_file())
    assert (int(match.group(3)) if match.group(3) else None) == (saved[-1] if saved else None), (line, saved)
    assert stderr.count("interrupted (") == 1


# ----------------------------------------------------------------- 4. config errors (CLI)


def test_cli_config_errors_exit_2_naming_the_key(tiny_data, tmp_path, monkeypatch, capsys):
    from sorl_megatron.train import main

    data = run_overrides(tiny_data, tmp_path, "bad")
    proc = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.train", "--config", BASE_RECIPE, *data, "algorithm.loss.nme=ppo"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "algorithm.loss.nme" in proc.stderr and "did you mean algorithm.loss.name" in proc.stderr

    def error(*overrides, world_size="1"):
        monkeypatch.setenv("WORLD_SIZE", world_size)
        assert main(["--config", BASE_RECIPE, *data, *overrides]) == 2
        return capsys.readouterr().err

    assert "schedule.total_steps must be an integer" in error("schedule.total_steps=abc")
    assert "rollout.group_size" in error("rollout.group_size=zero")
    assert "parallelism: tp x pp = 2 x 1 = 2 does not divide the world size 3" in error(
        "parallelism.tp=2", world_size="3"
    )
    assert "parallelism.tp=4 does not divide the model's 4 attention / 2 KV heads" in error(
        "parallelism.tp=4", world_size="4"
    )
    assert "parallelism.ep=3 does not divide the model's 4 experts" in error("parallelism.ep=3", world_size="3")
    assert "parallelism.pp x vpp = 4 does not divide the model's 2 layers" in error("parallelism.pp=4", world_size="4")
    msg = error("schedule.micro_batch_size=2", world_size="2")  # DP=2: micro 2 x DP 2 does not divide mini 2
    assert "schedule.mini_batch_size=2 must be a multiple of schedule.micro_batch_size x data-parallel size" in msg
    odd = tmp_path / "odd_vocab"
    odd.mkdir()
    hf = json.loads((tiny_data / "model" / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**hf, "vocab_size": 521}))
    assert "parallelism.tp=2 does not divide the model's vocab_size 521" in error(
        f"model.path={odd}", "parallelism.tp=2", world_size="2"
    )


# ---------------------------------------------------- 5. servers are stopped after failures


def test_servers_stopped_after_failures(tiny_data, server_spy, monkeypatch, tmp_path):
    from sorl_megatron.trainer.rl_loop import RLTrainer

    # a real build failure after the retrieval server started: the critic's checkpoint is missing
    bad_critic = run_overrides(tiny_data, tmp_path, "bad_critic", "algorithm.loss.name=so_ppo",
                               "algorithm.advantage.estimator=gae", f"model.critic_path={tmp_path / 'no_such_model'}")
    with pytest.raises(Exception, match="no_such_model"):
        _trainer(bad_critic).run()
    assert [p.args[2] for p in server_spy] == ["sorl_megatron.retrieval.server"]
    _assert_reaped(server_spy)

    # Ctrl-C in the middle of the first step, with both servers up (crafted: step raises)
    server_spy.clear()

    def interrupted(self, step):
        raise KeyboardInterrupt("crafted Ctrl-C")

    monkeypatch.setattr(RLTrainer, "step", interrupted)
    with pytest.raises(KeyboardInterrupt, match="during RL step 1 of 20") as err:  # the phase it stopped in
        _trainer(run_overrides(tiny_data, tmp_path, "interrupted")).run()
    assert "crafted Ctrl-C" in str(err.value.__context__ or err.value.__cause__)
    started = sorted(p.args[2] for p in server_spy)
    assert started == ["sorl_megatron.retrieval.server", "sorl_megatron.sglang_cpu.server"]
    _assert_reaped(server_spy)


# ------------------------------------------------ 6. PVPO filtering and GT injection, crafted


class CraftedPVPORewards(RewardRegistry):
    """Crafted per-prompt outcomes: ``crafted_solved`` always scores 1, ``crafted_unsolved``
    never, ``crafted_mixed`` alternates 1, 0, 1, 0 (so every group of an even size is half
    solved). The rollouts themselves are real (tiny model on the shared server)."""

    mixed_calls = 0

    def get(self, data_source):  # the crafted sources are known to the input checks
        return super().get("nq" if data_source.startswith("crafted_") else data_source)

    def score(self, data_source, response, ground_truth):
        if data_source == "crafted_mixed":
            CraftedPVPORewards.mixed_calls += 1
            return float(CraftedPVPORewards.mixed_calls % 2)
        return {"crafted_solved": 1.0, "crafted_unsolved": 0.0}[data_source]


def test_pvpo_filtering_and_ground_truth_injection(tiny_data, shared_servers, monkeypatch, tmp_path):
    from sorl_megatron.data.qa import read_parquet, write_parquet
    from sorl_megatron.trainer.rl_loop import RLTrainer

    rows = read_parquet(tiny_data / "train.parquet")[:3]
    sources = ["crafted_solved", "crafted_unsolved", "crafted_mixed"]
    crafted = [dataclasses.replace(r, data_source=s) for r, s in zip(rows, sources)]
    write_parquet(crafted, tmp_path / "crafted.parquet")
    monkeypatch.setattr("sorl_megatron.trainer.rl_loop.RewardRegistry", CraftedPVPORewards)
    CraftedPVPORewards.mixed_calls = 0

    seen = {"passes": [], "steps": []}

    from sorl_megatron.trainer.serving.connections import Connections
    from sorl_megatron.trainer.sources.modes import RolloutSource
    from sorl_megatron.trainer.stages.drivers import PVPOStage

    class Spy(RLTrainer):
        def advantages(self, batch, rewards, values):
            adv, returns = super().advantages(batch, rewards, values)
            seen["steps"].append((batch, rewards.clone(), adv))
            return adv, returns

    reference_pass, rollouts, draw_groups = PVPOStage.reference_pass, Connections.rollouts, RolloutSource.draw_groups

    def spy_reference_pass(self, step=0):
        metrics = reference_pass(self, step)
        seen["passes"].append((step, copy.deepcopy(self.state), list(self.stream.indices)))
        return metrics

    def spy_rollouts(self, *args, **kw):  # the PVPO passes
        res = rollouts(self, *args, **kw)
        seen.setdefault("versions", []).append({v for t in res.trajectories for v in t.weight_versions})
        return res

    def spy_draw_groups(self, count):  # a training step's rollouts
        groups = draw_groups(self, count)
        seen.setdefault("versions", []).append({v for g in groups for t in g.trajectories for v in t.weight_versions})
        return groups

    from sorl_megatron.engine.actor import PolicyEngine

    update = PolicyEngine.update

    def spy_update(self, batch, old_from_forward=None):  # the rows whose old log-probs the update takes
        seen.setdefault("from_forward", []).append(old_from_forward)
        return update(self, batch, old_from_forward)

    monkeypatch.setattr(PolicyEngine, "update", spy_update)
    monkeypatch.setattr(PVPOStage, "reference_pass", spy_reference_pass)
    monkeypatch.setattr(Connections, "rollouts", spy_rollouts)
    monkeypatch.setattr(RolloutSource, "draw_groups", spy_draw_groups)

    overrides = run_overrides(tiny_data, tmp_path, "pvpo", f"data.train={tmp_path / 'crafted.parquet'}",
                              "algorithm.loss.name=grpo", "algorithm.advantage.estimator=pvpo",
                              "algorithm.pvpo.num_ref_rollouts=2", "algorithm.pvpo.inject_ground_truth=true",
                              "algorithm.pvpo.refresh_every=1", "schedule.total_steps=2", *shared_servers,
                              # room for the gold plan (search, then answer) of a one-hop question
                              "rollout.max_turns=3", "rollout.max_turn_tokens=32", "rollout.max_total_tokens=420")
    trainer = _trainer(overrides, Spy)
    trainer.run()

    # group sampling on the reference pass: index 0 (always solved) is dropped
    (step0, state0, keep0), (step1, state1, keep1) = seen["passes"]
    assert step0 == 0 and state0.accuracy == {0: 1.0, 1: 0.0, 2: 0.5} and state0.static_v == {0: 1.0, 1: 0.0, 2: 0.5}
    assert keep0 == [1, 2]
    # refresh_every=1: static V is refreshed before step 2 on the kept prompts only
    assert step1 == 1 and state1.refreshed_at_step == 1 and set(state1.accuracy) == {1, 2} and keep1 == [1, 2]

    # the servers were labelled with the weights each rollout phase used: reference pass and
    # step 1 on the start weights (synced at start, external servers), the refresh and step 2 on step 1's
    assert seen["versions"] == [{"step_0"}, {"step_0"}, {"step_1"}, {"step_1"}]
    tokenizer = trainer.tokenizer
    metrics = read_metrics(tmp_path / "pvpo")
    assert {
        k: metrics[0][k] for k in ("pvpo/kept", "pvpo/dropped", "pvpo/unsolved", "pvpo/ground_truth_available")
    } == {"pvpo/kept": 2, "pvpo/dropped": 1, "pvpo/unsolved": 1, "pvpo/ground_truth_available": 1}
    assert metrics[0]["pvpo/static_v_mean"] == pytest.approx(0.5) and metrics[2]["time/pvpo_reference"] > 0
    for k, (batch, rewards, adv) in enumerate(seen["steps"]):
        assert metrics[k + 1]["rollout/injected_ground_truth"] == 1.0
        groups = batch.group_ids.tolist()
        assert sorted(groups) == [1, 1, 2, 2]
        gt = max(i for i, g in enumerate(groups) if g == 1)  # the last rollout of the unsolved group
        text = tokenizer.decode(batch.input_ids[gt][batch.attention_mask[gt].bool()].tolist())
        assert f"<answer> {rows[1].targets[0]} </answer>" in text
        assert rewards.tolist() == [
            1.0 if i == gt else (0.0 if g == 1 else rewards[i].item()) for i, g in enumerate(groups)
        ]
        assert sorted(rewards[[i for i, g in enumerate(groups) if g == 2]].tolist()) == [0.0, 1.0]
        # PVPO eq. 6: the GT row's old log-probs are its generating policy's, not the current policy's
        assert torch.equal(batch.old_logprobs[gt], batch.rollout_logprobs[gt])
        flags = seen["from_forward"][k]  # nor does the update's first mini-batch take them from its forward
        assert flags is not None and not flags[gt] and 1 <= int(flags.sum()) <= 2
        other = next(i for i, g in enumerate(groups) if g == 1 and i != gt)
        assert not torch.equal(batch.old_logprobs[other], batch.rollout_logprobs[other])
        # PVPO advantages r - V_static, broadcast over policy tokens (no whitening)
        v = {1: 0.0, 2: 0.5} if k == 0 else {g: seen["passes"][1][1].static_v[g] for g in (1, 2)}
        for i, g in enumerate(groups):
            on = batch.loss_mask[i].bool()
            assert on.any()
            assert torch.allclose(adv[i][on], torch.full_like(adv[i][on], rewards[i].item() - v[g])), (k, i)
    assert_finite(metrics[2], "pvpo")
    # a gold plan cut by the budgets is not a correct trajectory: it is not injected
    assert set(trainer.conn.gold_trajectories([1], complete_only=True)) == {1}
    trainer.cfg.rollout.max_turn_tokens = 12
    assert trainer.conn.gold_trajectories([1], complete_only=True) == {}
    saved = json.loads((tmp_path / "pvpo" / "ckpt" / "step_2" / "trainer.json").read_text())["extra"]["pvpo"]
    assert saved["keep"] == [1, 2] and saved["refreshed_at_step"] == 1


# ------------------------------------------------------------------- 6. SFT cold start


def test_sft_cold_start_writes_the_policy_rl_starts_from(tiny_data, shared_servers, tmp_path, monkeypatch):
    """The SFT stage trains on every training row's gold trajectory played through the agent
    loop, saves the HF checkpoint RL starts from, and a rerun of the finished run skips it."""
    from safetensors.torch import load_file

    from sorl_megatron.data.gold import cold_start_plans
    from sorl_megatron.data.qa import read_parquet
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.serving.connections import Connections

    calls = []
    gold_trajectories = Connections.gold_trajectories

    def spy(self, indices, complete_only=False, plans=None):
        out = gold_trajectories(self, indices, complete_only, plans)
        calls.append(out)
        return out

    monkeypatch.setattr(Connections, "gold_trajectories", spy)

    overrides = run_overrides(tiny_data, tmp_path, "sft", "sft.enabled=true", "sft.steps=2", "sft.batch_size=2",
                              "sft.direct_answer_fraction=0.5", "schedule.total_steps=1", *shared_servers,
                              "rollout.max_turns=3", "rollout.max_turn_tokens=32", "rollout.max_total_tokens=420")
    _trainer(overrides).run()
    rows = read_parquet(tiny_data / "train.parquet")
    (gold,) = calls
    plans = cold_start_plans(rows, 0.5, load_recipe(BASE_RECIPE, overrides).schedule.seed)
    assert sorted(gold) == sorted(plans) == list(range(len(rows)))
    assert {bool(p.searches) for p in plans.values()} == {True, False}  # both kinds of demonstration are there
    for i, traj in gold.items():
        assert traj.finish_reason == "answer" and traj.response_text.rstrip().endswith(
            f"<answer> {plans[i].answer} </answer>"
        )
        assert traj.num_searches == len(plans[i].searches), i
        if plans[i].searches:  # a searching demonstration is the row's gold plan
            assert plans[i].searches == rows[i].extra_info["gold_searches"] and plans[i].answer == rows[i].targets[0]
    sft_dir = tmp_path / "sft" / "sft_model"
    assert (sft_dir / "SFT_DONE").is_file() and (sft_dir / "tokenizer.json").is_file()
    sft_rows = read_metrics(tmp_path / "sft" / "sft")
    assert sorted(sft_rows) == [1, 2] and all(
        math.isfinite(r["sft/nll"]) and r["sft/nll"] > 0 for r in sft_rows.values()
    )
    init, sft = load_file(tiny_data / "model" / "model.safetensors"), load_file(sft_dir / "model.safetensors")
    assert any(not torch.equal(init[k], sft[k]) for k in init)  # SFT changed the weights RL starts from
    assert read_metrics(tmp_path / "sft")[1]["actor/policy_tokens"] > 0
    _trainer(overrides).run()  # the finished run: SFT is not redone
    assert len(calls) == 1


# ------------------------------------------------- 7. BF16 training with FP8 rollouts (MiniRL)


def test_bf16_training_with_fp8_rollouts_recipe_trains(tiny_data, shared_servers, length_reward, tmp_path):
    """recipes/tiny_search_bf16_fp8.yaml: the actor trains in megatron's BF16 mixed precision
    while its own embedded server generates with FP8 weights (R3 routes, token-level TIS).
    The crafted length reward gives the GRPO groups a signal (a random model answers nothing)."""
    from sorl_megatron.trainer.recipe.loader import load_recipe
    from sorl_megatron.trainer.rl_loop import RLTrainer

    recipe = ROOT / "recipes" / "tiny_search_bf16_fp8.yaml"
    retrieval = [o for o in shared_servers if o.startswith("retrieval.url=")]
    cfg = load_recipe(recipe, run_overrides(tiny_data, tmp_path, "bf16_fp8", "schedule.total_steps=2", *retrieval))
    assert (cfg.model.dtype, cfg.rollout.precision, cfg.algorithm.routing_replay) == ("bfloat16", "fp8", "r3")
    assert not cfg.rollout.urls  # the embedded server, in FP8
    trainer = RLTrainer(cfg)
    trainer.run()
    rows = {k: m for k, m in read_metrics(tmp_path / "bf16_fp8").items() if k > 0}  # step 0: start-up time
    assert sorted(rows) == [1, 2]
    for step, m in rows.items():
        assert_finite(m, f"step {step}")
        assert m["rollout/policy_tokens"] > 0 and m["actor/grad_norm"] > 0 and m["actor/update_ok"] == 1
        assert m["old/routing/replayed_pairs"] > 0  # the FP8 server's routes, replayed
        assert m["actor/is/mismatch_abs_mean"] > 0  # FP8 rollouts vs BF16 training differ: TIS has work
    params = {p.dtype for c in trainer.actor.model.chunks for p in c.parameters()}
    optimizers = [type(o).__name__ for o in trainer.actor.optimizer.chained_optimizers]
    assert params == {torch.bfloat16} and optimizers == ["Float16OptimizerWithFloat16Params"]
    assert "(fp8, moe=True)" in (tmp_path / "bf16_fp8" / "servers" / "rollout.log").read_text()
