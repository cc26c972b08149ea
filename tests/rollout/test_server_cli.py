"""The server as users start it: ``python -m sorl_megatron.sglang_cpu.server``."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
from sorl_megatron.sglang_cpu.server import parse_args
from tests.served import served

FLAGS = [
    "--model-path",
    "--tokenizer-path",
    "--host",
    "--port",
    "--precision",
    "--dtype",
    "--quantization",
    "--fp8-block-size",
    "--enable-return-routed-experts",
    "--inject-route-flip-fraction",
    "--inject-route-flip-seed",
    "--skip-tokenizer-init",
    "--max-running-requests",
    "--context-length",
    "--random-seed",
    "--weight-version",
    "--num-threads",
    "--disable-radix-cache",
    "--prefix-cache-max-tokens",
    "--enable-deterministic-inference",
    "--api-key",
    "--max-body-mb",
    "--max-weight-body-mb",
    "--max-prompts-per-request",
    "--max-tokens-per-request",
    "--weight-group-timeout-s",
    "--weight-group-join-timeout-s",
    "--max-weight-group-joins",
    "--control-timeout-s",
    "--weight-body-wait-s",
    "--sglang-version",
    "--log-level",
]


def test_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.sglang_cpu.server", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag
    # every defined option is in the list above (a new flag must be documented and tested)
    defined = set(re.findall(r"--[a-z0-9-]+", out.stdout))
    assert defined - {"--help"} == set(FLAGS)


def test_the_old_module_name_still_runs_the_server_and_says_where_it_moved(tmp_path):
    """``python -m sorl_megatron.rollout.server`` (the name before sglang_cpu/) forwards its arguments
    to ``sorl_megatron.sglang_cpu.server`` for one release, saying so on stderr."""
    moved = "it runs python -m sorl_megatron.sglang_cpu.server now"
    out = subprocess.run([sys.executable, "-m", "sorl_megatron.rollout.server", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "deprecated" in out.stderr and moved in out.stderr
    assert out.stdout.startswith("usage: python -m sorl_megatron.sglang_cpu.server") and "--model-path" in out.stdout
    missing = tmp_path / "nowhere"
    out = subprocess.run([sys.executable, "-m", "sorl_megatron.rollout.server", "--model-path", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"error: --model-path '{missing}' does not exist" in out.stderr


def test_sglang_style_aliases():
    assert parse_args(["--model-path", "m"]).precision == "fp32"
    assert parse_args(["--model-path", "m", "--quantization", "fp8"]).precision == "fp8"
    assert parse_args(["--model-path", "m", "--dtype", "bfloat16"]).precision == "bf16"
    assert parse_args(["--model-path", "m", "--dtype", "bfloat16", "--precision", "fp32"]).precision == "fp32"
    assert parse_args(["--model-path", "m"]).host == "127.0.0.1"
    assert parse_args(["--model-path", "m"]).sglang_version == "0.5.21"
    assert parse_args(["--model-path", "m", "--sglang-version", "0.5.18"]).sglang_version == "0.5.18"


def test_subprocess_server_skip_tokenizer_init(moe_dir, tmp_path):
    argv = lambda port: [sys.executable, "-m", "sorl_megatron.sglang_cpu.server",  # noqa: E731
                         "--model-path", str(moe_dir), "--port", str(port), "--enable-return-routed-experts",
                         "--skip-tokenizer-init", "--num-threads", "1", "--weight-version", "w0"]
    with served(argv, tmp_path / "server.log") as (url, _):

        async def go():
            async with RolloutClient(RolloutClientConfig(urls=(url,), routing_shape=(2, 2))) as c:
                return await c.generate(
                    [4, 5, 6], SamplingParams(max_new_tokens=5, ignore_eos=True, n=2), return_routed_experts=True
                )

        outs = asyncio.run(asyncio.wait_for(go(), 60))
        assert len(outs) == 2
        for o in outs:
            assert o.text is None and o.weight_version == "w0"  # no tokenizer: tokens only
            assert o.routed_experts.shape == (3 + 5 - 1, 2, 2)
            assert len(o.output_logprobs) == 5


def test_a_mistyped_model_path_is_named_not_taken_for_a_hub_repo(tmp_path):
    """The path as the user typed it, what is wrong with it, exit code 2, no traceback and no
    Hugging Face Hub message."""
    missing = tmp_path / "data" / "synt" / "model"
    out = subprocess.run([sys.executable, "-m", "sorl_megatron.sglang_cpu.server", "--model-path", str(missing)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: --model-path '{missing}' does not exist: a local directory is needed; "
                                  "nothing is downloaded")
    relative = subprocess.run([sys.executable, "-m", "sorl_megatron.sglang_cpu.server", "--model-path", "runs/x/model"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert relative.returncode == 2
    assert relative.stderr.strip() == ("error: --model-path 'runs/x/model' does not exist (relative to the working "
                                       f"directory {tmp_path}): a local directory is needed; nothing is downloaded")


def test_model_and_tokenizer_paths_that_are_not_checkpoints(tmp_path, capsys, moe_dir):
    import pytest

    from sorl_megatron.bridge.hf_config import CheckpointFileError
    from sorl_megatron.sglang_cpu.engine import RolloutEngine
    from sorl_megatron.sglang_cpu.options import EngineConfig
    from sorl_megatron.sglang_cpu.server import main

    a_file, empty = tmp_path / "weights.safetensors", tmp_path / "empty"
    a_file.write_bytes(b"")
    empty.mkdir()
    cases = [
        (["--model-path", str(a_file)], f"error: --model-path '{a_file}' is not a directory"),
        (["--model-path", str(empty)], f"error: --model-path '{empty}' is not an HF model checkpoint: "
                                       f"{empty / 'config.json'} not found"),
        (["--model-path", str(moe_dir), "--tokenizer-path", str(tmp_path / "tok")],
         f"error: --tokenizer-path '{tmp_path / 'tok'}' does not exist"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.startswith(message)
    # the engine checks the same in-process (the trainer's tests and embedders build it directly)
    with pytest.raises(CheckpointFileError, match=rf"rollout model path '{empty}' is not an HF model checkpoint"):
        RolloutEngine(EngineConfig(model_path=str(empty)))


def test_an_empty_api_key_is_refused_in_one_line():
    """``--api-key ""`` would mean no authentication at all: refused before anything loads."""
    out = subprocess.run([sys.executable, "-m", "sorl_megatron.sglang_cpu.server", "--model-path", "x",
                          "--api-key", ""], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(
        "error: --api-key must be a non-empty printable string (leave it unset for no authentication)")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("flags,message", [
    (["--context-length", "-1"], "argument --context-length: must be in [1, 16777216], got -1"),
    (["--fp8-block-size", "0", "--quantization", "fp8"], "argument --fp8-block-size: must be in [1, 4096], got 0"),
    (["--max-body-mb", "-1"], "argument --max-body-mb: must be in [1, 1048576], got -1"),
    (["--control-timeout-s", "nan"], "argument --control-timeout-s: must be in (0, 86400] seconds, got nan"),
    (["--weight-body-wait-s", "0"], "argument --weight-body-wait-s: must be in (0, 86400] seconds, got 0"),
    (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
])
def test_out_of_range_flags_stop_the_server_in_one_line(flags, message, capsys):
    """Each used to start a server that refused or broke every request."""
    from sorl_megatron.sglang_cpu.server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", "x", *flags])
    assert exc.value.code == 2 and capsys.readouterr().err.strip().endswith(message)
