"""run.lock and the run directory are never followed, truncated or trusted when they are not
what they should be (issue 49, items 2 and 8): a symbolic or hard link at ``run.lock`` leaves
its target as it was; a directory or FIFO there, a run directory that is a file and a
``logging.dir`` that is a file are refused with one line, no traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sorl_megatron.common.run_lock import LOCK_NAME, RunLockError, acquire_run_lock

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "tiny_search_base.yaml"
SECRET = "keep: this file is not the lock's\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text(SECRET)
    return victim


def _unchanged(victim: Path, before: os.stat_result) -> None:
    assert victim.read_text() == SECRET
    after = victim.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_at_run_lock_is_refused_and_its_target_left_alone(tmp_path, link):
    victim = _victim(tmp_path)
    before = victim.stat()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (os.symlink if link == "symlink" else os.link)(victim, run_dir / LOCK_NAME)
    with pytest.raises(RunLockError, match="symbolic link" if link == "symlink" else "hard link") as err:
        acquire_run_lock(run_dir)
    assert str(run_dir / LOCK_NAME) in str(err.value) and "\n" not in str(err.value)
    _unchanged(victim, before)
    # a dangling symbolic link is not created through either
    (run_dir / LOCK_NAME).unlink()
    target = tmp_path / "elsewhere" / "created.txt"
    os.symlink(target, run_dir / LOCK_NAME)
    with pytest.raises(RunLockError, match="symbolic link"):
        acquire_run_lock(run_dir)
    assert not target.exists()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_fifo_at_run_lock_is_one_line(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (os.mkdir if kind == "directory" else os.mkfifo)(run_dir / LOCK_NAME)
    with pytest.raises(RunLockError, match="a directory" if kind == "directory" else "a FIFO") as err:
        acquire_run_lock(run_dir)
    assert "\n" not in str(err.value)


def test_train_says_one_line_for_each_unusable_run_directory(tmp_path, monkeypatch, capsys):
    import sorl_megatron.train as train

    monkeypatch.setattr(train, "validate_layout_for_launch", lambda cfg, world: None)  # no model files here
    monkeypatch.delenv("RANK", raising=False)
    victim = _victim(tmp_path)
    before = victim.stat()
    cases = {}
    (tmp_path / "linked").mkdir()
    os.symlink(victim, tmp_path / "linked" / LOCK_NAME)
    cases["linked"] = ([f"logging.dir={tmp_path}", "logging.run_name=linked"], "symbolic link")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / LOCK_NAME)
    cases["fifo"] = ([f"logging.dir={tmp_path}", "logging.run_name=fifo"], "a FIFO")
    (tmp_path / "lockdir" / LOCK_NAME).mkdir(parents=True)
    cases["lockdir"] = ([f"logging.dir={tmp_path}", "logging.run_name=lockdir"], "a directory")
    (tmp_path / "plain").write_text("a file where the run directory goes\n")
    cases["file"] = ([f"logging.dir={tmp_path}", "logging.run_name=plain"], "is a file")
    (tmp_path / "logs.txt").write_text("a file where logging.dir goes\n")
    cases["dir"] = ([f"logging.dir={tmp_path / 'logs.txt'}", "logging.run_name=x"], "is a file")
    for name, (overrides, match) in cases.items():
        capsys.readouterr()
        code = train.main(["--config", str(BASE), *overrides])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and match in lines[0], (name, err[-3000:])
    _unchanged(victim, before)
