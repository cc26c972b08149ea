"""Inputs that gave a traceback (or printed another file's lines) give one line instead
(issue 49, item 8): a 300-character logging.run_name, parallelism.collective_timeout_s=1e30,
WORLD_SIZE=abc, --print-memory with a zeroed model config, a recipe whose ``defaults`` names
/etc/passwd, and the rollout server's ``--sglang-version garbage``. (run.lock a directory or
FIFO, a run directory or logging.dir that is a file: test_run_lock_safety.py; convert's --out:
tests/bridge/test_convert_cli.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "tiny_search_base.yaml"


@pytest.fixture
def train(monkeypatch, capsys):
    """``python -m sorl_megatron.train ARGS`` in this process: (exit code, stderr's lines)."""
    import sorl_megatron.train as module

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(*args: str, config: Path = BASE) -> tuple[int, list[str]]:
        capsys.readouterr()
        code = module.main(["--config", str(config), *args])
        return code, [x for x in capsys.readouterr().err.splitlines() if x.strip()]

    return run


def test_a_run_name_longer_than_a_file_name_allows(train, tmp_path):
    code, err = train(f"logging.dir={tmp_path}", f"logging.run_name={'r' * 300}")
    assert code == 2 and len(err) == 1 and "logging.run_name is 300 bytes long" in err[0], err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("key", ["collective_timeout_s", "rank0_phase_timeout_s"])
def test_a_collective_timeout_beyond_a_week(train, key):
    code, err = train(f"parallelism.{key}=1e30")
    assert code == 2 and len(err) == 1 and f"parallelism.{key} must be at most 604800 seconds" in err[0], err


@pytest.mark.parametrize("name,value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("RANK", "x")])
def test_a_world_size_or_rank_that_is_not_a_number(train, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    for extra in ([], ["--print-memory"]):
        code, err = train(*extra)
        assert code == 2 and len(err) == 1 and f"${name}={value!r} must be an integer" in err[0], (extra, err)


def test_print_memory_with_a_zeroed_model_config(train, tmp_path):
    zeroed = {k: 0 for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                             "intermediate_size", "num_key_value_heads")}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **zeroed}))
    code, err = train("--print-memory", "--model-config", str(tmp_path / "config.json"))
    assert code == 2 and len(err) == 1 and "must be an integer in [1," in err[0], err


def test_recipe_defaults_naming_another_file_do_not_print_it(train, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    for target in ("/etc/passwd", str(secret)):
        recipe = tmp_path / "evil.yaml"
        recipe.write_text(f"defaults: [{target}]\n")
        code, err = train(config=recipe)
        assert code == 2 and len(err) == 1 and "is not a recipe (a .yaml or .yml file)" in err[0], err
        assert "root:" not in err[0] and "daemon:" not in err[0]
    # a key is never echoed whole (a mis-read file's lines would be)
    odd = tmp_path / "odd.yaml"
    odd.write_text(json.dumps({secret.read_text().replace("\n", " "): None}))
    code, err = train(config=odd)
    assert code == 2 and len(err) == 1 and "unknown config key(s): root:x:0:0" in err[0], err
    assert "daemon:x:1:1" not in err[0]


def test_the_servers_sglang_version_must_be_a_release(capsys):
    from sorl_megatron.sglang_cpu.server import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model-path", "m", "--sglang-version", "garbage"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--sglang-version must be a release like 0.5.21, got 'garbage'" in err and "Traceback" not in err
