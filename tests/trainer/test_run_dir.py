"""A run directory has one writer (common/run_lock.py) and holds one run: other defining
settings under the same name are refused (trainer/recipe/run_settings.py); the finished-run advice
gives the command as it was typed; the demo names a variant's run after its overrides."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sorl_megatron.common.run_lock import LOCK_NAME, RunLockedError, acquire_run_lock
from sorl_megatron.trainer.recipe.inputs import InputError, check_resume_dir
from sorl_megatron.trainer.recipe.loader import dump_config, load_recipe
from sorl_megatron.trainer.recipe.run_settings import RERUN_ENV, rerun_command, run_settings_problem

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "tiny_search_base.yaml"

HOLDER = """
import sys, time
from sorl_megatron.common.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1])
(lock.path.parent / "notes.txt").write_text("written")  # the directory is the run's, not empty
print("locked", flush=True)
time.sleep(120)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunLockedError) as err:
            acquire_run_lock(run_dir)
        text = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()} since 20" in text and "in use" in text
        assert "logging.run_name=" in text
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel releases the flock
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="sorl_megatron"):
        lock = acquire_run_lock(run_dir)
    assert f"taking over the lock left by pid {holder.pid}" in caplog.text
    assert f"pid: {os.getpid()}" in (run_dir / LOCK_NAME).read_text()
    lock.release()
    # released normally: the file is emptied, so the next holder has nothing to take over
    assert (run_dir / LOCK_NAME).read_text() == ""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sorl_megatron"), acquire_run_lock(run_dir):
        pass
    assert "taking over" not in caplog.text


def test_a_lock_taken_for_nothing_leaves_no_directory(tmp_path):
    """An input error before anything was written: the run directory the lock made goes away."""
    with acquire_run_lock(tmp_path / "new" / "run"):
        assert (tmp_path / "new" / "run" / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists()  # logging.dir too, when the lock made it
    (tmp_path / "old").mkdir()
    with acquire_run_lock(tmp_path / "old"):
        pass
    assert (tmp_path / "old" / LOCK_NAME).read_text() == ""  # a directory that was there stays


def test_a_child_shares_its_parents_lock_and_no_one_else_does(tmp_path):
    run_dir = tmp_path / "run"
    script = "import sys; from sorl_megatron.common.run_lock import acquire_run_lock; acquire_run_lock(sys.argv[1])"
    with acquire_run_lock(run_dir) as lock:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        shared = subprocess.run([sys.executable, "-c", script, str(run_dir)], env={**env, **lock.child_env()},
                                pass_fds=(lock.fd,), capture_output=True, text=True)
        assert shared.returncode == 0, shared.stderr
        alone = subprocess.run([sys.executable, "-c", script, str(run_dir)], env=env, capture_output=True, text=True)
        assert alone.returncode != 0 and f"pid {os.getpid()}" in alone.stderr
        assert f"pid: {os.getpid()}" in (run_dir / LOCK_NAME).read_text()  # the child did not rewrite it


def test_train_refuses_a_run_directory_in_use(tmp_path, monkeypatch, capsys):
    import sorl_megatron.train as train

    monkeypatch.setattr(train, "validate_layout_for_launch", lambda cfg, world: None)  # no model files here
    monkeypatch.delenv("RANK", raising=False)
    with acquire_run_lock(tmp_path / "mine"):
        code = train.main(["--config", str(BASE), f"logging.dir={tmp_path}", "logging.run_name=mine"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run directory in use: run directory {tmp_path / 'mine'} is in use: pid {os.getpid()}")


# -- defining settings --------------------------------------------------------------------------


def _cfg(tmp_path, *extra):
    return load_recipe(BASE, [f"logging.dir={tmp_path}", "logging.run_name=mine", "schedule.total_steps=4",
                              "model.path=m/model", "data.train=d/train.parquet", *extra])


def _started(cfg) -> None:
    """What the trainer leaves when a run starts: config.yaml in the run directory."""
    run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))


def test_other_defining_settings_under_the_same_run_name_are_refused(tmp_path):
    _started(_cfg(tmp_path, "schedule.seed=1"))
    # the same run, resumed or extended, or changed in what does not define it
    for same in ([], ["schedule.total_steps=12", "logging.progress=none", "schedule.val_every=2"],
                 [f"model.path={os.path.abspath('m/model')}"]):
        assert run_settings_problem(_cfg(tmp_path, "schedule.seed=1", *same)) is None, same
    other = _cfg(tmp_path, "schedule.seed=2", "algorithm.loss.name=grpo", "algorithm.advantage.estimator=grpo")
    problem = run_settings_problem(other)
    assert problem.startswith(f"logging.run_name=mine: the run directory {tmp_path / 'mine'} holds a run with "
                              "other settings")
    assert "  schedule.seed: 1 there, 2 now" in problem
    assert "  algorithm.loss.name: 'so_grpo' there, 'grpo' now" in problem
    assert "e.g. logging.run_name=mine_grpo_seed2" in problem
    with pytest.raises(InputError, match="schedule.seed: 1 there, 2 now"):
        check_resume_dir(other)
    for key, value in (("schedule.batch_size", 16), ("rollout.group_size", 16), ("schedule.mini_batch_size", 16),
                       ("schedule.ppo_epochs", 2), ("data.train", "e/train.parquet"), ("model.path", "x/model")):
        assert f"{key}: " in run_settings_problem(_cfg(tmp_path, "schedule.seed=1", f"{key}={value}")), key


def test_a_run_started_before_the_rollout_keys_moved_is_the_same_run(tmp_path):
    """A run directory written before issue 44 holds the flat rollout keys in its config.yaml
    (rollout.max_staleness, rollout.weight_sync: disk, ...). None of the moved keys is a defining
    setting, so the guard, which reads only those, resumes it; the recipe that resumes it must
    give the new keys (the loader refuses the old ones)."""
    import yaml

    from sorl_megatron.trainer.recipe.loader import MOVED_KEYS
    from sorl_megatron.trainer.recipe.run_settings import DEFINING_KEYS

    assert not set(DEFINING_KEYS) & {*MOVED_KEYS, *MOVED_KEYS.values()}  # none of them moved
    cfg = _cfg(tmp_path, "rollout.mode=lagged", "rollout.lagged.lag=2", "rollout.staleness.max=2")
    _started(cfg)
    saved = Path(cfg.logging.dir) / cfg.logging.run_name / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    r = old["rollout"]
    weight_sync, fleet, staleness = r.pop("weight_sync"), r.pop("fleet"), r.pop("staleness")
    r.update({"weight_sync": weight_sync["transport"], "max_staleness": staleness["max"], "lag": r.pop("lagged")["lag"],
              "stale_groups": staleness["stale_groups"], **r.pop("async"), **fleet,
              **{f"weight_sync_{k}": v for k, v in weight_sync.items() if k != "transport"}})
    saved.write_text(yaml.safe_dump(old))
    assert "max_staleness: 2" in saved.read_text() and "weight_sync: distributed" in saved.read_text()
    assert run_settings_problem(cfg) is None
    assert "schedule.seed: 1234 there, 7 now" in run_settings_problem(_cfg(tmp_path, "schedule.seed=7"))


def test_a_finished_run_with_other_settings_is_refused_not_called_finished(tmp_path, monkeypatch):
    import sorl_megatron.trainer.rl_loop as rl_loop

    monkeypatch.setattr(rl_loop, "init_distributed", lambda **kw: None)
    _started(_cfg(tmp_path))
    with pytest.raises(InputError, match="schedule.seed: 1234 there, 7 now"):
        rl_loop.RLTrainer(_cfg(tmp_path, "schedule.seed=7")).run()


# -- the command as typed -----------------------------------------------------------------------


def test_rerun_command_writes_the_command_as_typed(monkeypatch):
    monkeypatch.delenv(RERUN_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    module = str(ROOT / "sorl_megatron" / "train.py")  # argv[0] of `python -m sorl_megatron.train`
    argv = [module, "--config", "recipes/x.yaml", "schedule.total_steps=4", "++logging.run_name=a b"]
    assert rerun_command("schedule.total_steps=8", argv=argv) == (
        "python -m sorl_megatron.train --config recipes/x.yaml '++logging.run_name=a b' schedule.total_steps=8")
    assert rerun_command("checkpoint.resume=none", argv=["tools/demo.py"]) == (
        "python tools/demo.py checkpoint.resume=none")
    assert rerun_command("x=1", argv=["/usr/bin/pytest", "-k", "x"]) is None  # not an entry point of ours
    monkeypatch.setenv(RERUN_ENV, 'make demo ARGS="{}"')
    assert rerun_command("schedule.total_steps=8", argv=["tools/demo.py", "schedule.seed=2"]) == (
        'make demo ARGS="schedule.seed=2 schedule.total_steps=8"')
    monkeypatch.delenv(RERUN_ENV)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    assert rerun_command("x=1", argv=argv) is None


def test_the_finished_message_gives_the_make_command(tmp_path, monkeypatch):
    from sorl_megatron.trainer.rl_loop import start_message

    monkeypatch.setenv(RERUN_ENV, 'make demo ARGS="{}"')
    monkeypatch.setattr(sys, "argv", ["tools/demo.py", "schedule.total_steps=4"])
    go, text = start_message(_cfg(tmp_path), Path("ck/step_4"), 4)
    assert not go
    assert 'to train it further, run `make demo ARGS="schedule.total_steps=8"`' in text
    assert 'to start over, run `make demo ARGS="schedule.total_steps=4 checkpoint.resume=none"`' in text


def _demo_module():
    spec = importlib.util.spec_from_file_location("_tools_demo", ROOT / "tools" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_names_a_variant_after_its_defining_overrides():
    run_name = _demo_module().run_name
    recipe = ROOT / "recipes" / "tiny_search_so_grpo.yaml"
    own = ["model.path=runs/tiny/model", "data.train=runs/tiny/train.parquet"]
    default = load_recipe(recipe, own)

    def name(*overrides):
        return run_name(load_recipe(recipe, own + list(overrides)), default, list(overrides))

    assert name() == default.logging.run_name == "so_grpo"
    assert name("schedule.total_steps=20", f"schedule.seed={default.schedule.seed}") == "so_grpo"  # same run
    assert name("schedule.seed=2", "algorithm.loss.name=grpo") == "so_grpo_grpo_seed2"
    assert name("schedule.seed=2", "logging.run_name=mine") == "mine"


# -- the study ----------------------------------------------------------------------------------


def _study_files(tmp_path: Path, seeds: str = "[1]") -> Path:
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")
    path = tmp_path / "study.yaml"
    path.write_text(f"recipe: {ROOT / 'recipes' / 'tiny_search_so_grpo.yaml'}\nstart_policy: {tmp_path / 'policy'}\n"
                    f"data: {tmp_path / 'data'}\nout: {tmp_path / 'out'}\nseeds: {seeds}\nparallel: 1\n"
                    "losses: {grpo: [algorithm.loss.name=grpo], so_grpo: [algorithm.loss.name=so_grpo]}\n"
                    "stress: {low: []}\nstop_timeout_s: 60\n")
    return path


def test_the_study_refuses_duplicate_cells_and_a_cell_in_use(tmp_path):
    from sorl_megatron.common.typed_config import ConfigError
    from sorl_megatron.study.runner import Cell, load_study, run_cell

    with pytest.raises(ConfigError, match=r"seeds lists \[1\] more than once"):
        load_study(_study_files(tmp_path, "[1, 2, 1]"))
    cfg = load_study(tmp_path / "study.yaml", ["seeds=[1]"])
    cell = Cell("grpo", "low", 1)
    with acquire_run_lock(Path(cfg.out) / "runs" / cell.name):
        _, code, what = run_cell(cfg, cell, Path(cfg.out))
    assert code == 2 and what.startswith("refused: run directory") and f"pid {os.getpid()}" in what


def test_an_interrupted_study_stops_its_running_cell_starts_no_other_and_says_one_line(tmp_path):
    """SIGINT to the study alone (the cells run in their own process groups): the running
    cell gets it once and exits, the next cell never starts, one line and no traceback."""
    study = _study_files(tmp_path)
    runs = tmp_path / "out" / "runs"
    code = ("import sys, sorl_megatron.study.runner as s; s.TRAIN_MODULE = 'tests.study_stub_train'; "
            "raise SystemExit(s.main(['--config', sys.argv[1]]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(study)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            # a shell's background job ignores SIGINT and children inherit that: take Python's default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (runs / "grpo__low__s1" / "stub_started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        # the study waits up to stop_timeout_s (60) for the cell; the rest is slack for a loaded
        # machine (this once took over 120 s in a full suite beside a running study)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "[study] interrupted (Ctrl-C): stopped the running cells and their servers; run the same command again to "
        "continue (finished cells are skipped, interrupted ones resume from their last checkpoint)"]
    assert (runs / "grpo__low__s1" / "stub_interrupted").is_file()
    assert not (runs / "so_grpo__low__s1").exists()


# -- outside the environment, redirected output ---------------------------------------------------


@pytest.mark.parametrize("argv", [["-m", "sorl_megatron.train", "--config", "x.yaml"],
                                  ["-m", "sorl_megatron.study", "--config", "x.yaml"],
                                  ["-m", "sorl_megatron.retrieval.server", "--corpus", "c.jsonl"],
                                  ["tools/demo.py"], ["tools/plot.py", "runs/x", "--out", "p"],
                                  ["tools/convert.py", "verify"], ["tools/make_synthetic_data.py"]])
def test_entry_points_outside_the_environment_say_how_to_enter_it(argv):
    """``python -S``: no site-packages, as a system python without torch."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/")}
    res = subprocess.run([sys.executable, "-S", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().endswith("run: source .venv/bin/activate (or make setup)")
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_progress_bar_is_plain_lines_when_not_on_a_terminal(tmp_path, capsys):
    from sorl_megatron.trainer.metrics.logger import MetricsLogger

    logger = MetricsLogger(tmp_path, 2, tensorboard=False, progress="tqdm")  # pytest's capture is no terminal
    logger.log(1, {"rollout/reward": 0.5})
    logger.log(2, {"rollout/reward": 0.75})
    logger.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert [line.split(" eta")[0] for line in out.splitlines()] == ["rl step 1/2 reward=0.5", "rl step 2/2 reward=0.75"]
