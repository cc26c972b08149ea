"""The server as users start it: ``python -m sorl_megatron.rollout.server``."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

from sorl_megatron.common.background import free_port, wait_healthy
from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.rollout.client import RolloutClient
from sorl_megatron.rollout.server import parse_args

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
    "--skip-tokenizer-init",
    "--max-running-requests",
    "--context-length",
    "--random-seed",
    "--weight-version",
    "--num-threads",
    "--disable-radix-cache",
    "--api-key",
    "--max-body-mb",
    "--max-weight-body-mb",
    "--max-prompts-per-request",
    "--max-tokens-per-request",
    "--log-level",
]


def test_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.rollout.server", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag
    # every defined option is in the list above (a new flag must be documented and tested)
    defined = set(re.findall(r"--[a-z0-9-]+", out.stdout))
    assert defined - {"--help"} == set(FLAGS)


def test_sglang_style_aliases():
    assert parse_args(["--model-path", "m"]).precision == "fp32"
    assert parse_args(["--model-path", "m", "--quantization", "fp8"]).precision == "fp8"
    assert parse_args(["--model-path", "m", "--dtype", "bfloat16"]).precision == "bf16"
    assert parse_args(["--model-path", "m", "--dtype", "bfloat16", "--precision", "fp32"]).precision == "fp32"
    assert parse_args(["--model-path", "m"]).host == "127.0.0.1"


def test_subprocess_server_skip_tokenizer_init(moe_dir):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sorl_megatron.rollout.server",
            "--model-path", str(moe_dir), "--port", str(port),
            "--enable-return-routed-experts", "--skip-tokenizer-init", "--num-threads", "1",
            "--weight-version", "w0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout_s=120, proc=proc)

        async def go():
            async with RolloutClient(url) as c:
                return await c.generate(
                    [4, 5, 6], SamplingParams(max_new_tokens=5, ignore_eos=True, n=2), return_routed_experts=True
                )

        outs = asyncio.run(asyncio.wait_for(go(), 60))
        assert len(outs) == 2
        for o in outs:
            assert o.text is None and o.weight_version == "w0"  # no tokenizer: tokens only
            assert o.routed_experts.shape == (3 + 5 - 1, 2, 2)
            assert len(o.output_logprobs) == 5
    finally:
        proc.terminate()
        proc.wait(timeout=20)
