"""The Slurm launcher (``python -m sorl_megatron.cluster``): the job TorchX renders (dry run,
on CPU), the checks before it, and the ``exec`` step each node runs."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sorl_megatron.cluster import FleetJob, main, resolve_hosts
from sorl_megatron.common.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny_search_base.yaml")
BASE = ["model.path=/models/policy", "data.train=/data/train.parquet"]


def sglang_env(workdir: Path, torch_version: str | None = None) -> Path:
    """A stand-in for what `make sglang-env` builds in the job's directory: this interpreter (the
    same torch, hence the same NCCL), or one that reports another torch release."""
    python = workdir / ".venv-sglang" / "bin" / "python"
    python.parent.mkdir(parents=True)
    if torch_version is None:
        python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    else:
        python.write_text(f"#!/bin/sh\necho '{{\"torch\": \"{torch_version}\", \"cuda\": \"13.0\", \"nccl\": null}}'\n")
    python.chmod(0o755)
    return python


def test_the_sglang_environment_must_share_the_trainers_nccl(tmp_path):
    sglang_env(tmp_path, torch_version="2.11.0+cu130")
    import torch

    with pytest.raises(ConfigError, match=rf"torch {re.escape(torch.__version__)} in the trainer's environment but "
                                          r"torch 2.11.0\+cu130 in the SGLang environment .*needs one NCCL"):
        FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path)).validate()


def test_nccl_versions_are_compared_where_both_are_known():
    from sorl_megatron.common.nccl_match import mismatch

    a = {"torch": "2.13.0+cu130", "nccl": "2.28.3"}
    assert mismatch(a, dict(a), "py") is None
    assert "NCCL 2.28.3 in the trainer's environment (torch 2.13.0+cu130) but NCCL 2.27.7" in mismatch(
        a, {"torch": "2.13.0+cu130", "nccl": "2.27.7"}, "py")


def test_dry_run_renders_the_whole_fleet(capsys, tmp_path):
    pytest.importorskip("torchx")
    sglang_env(tmp_path)
    code = main(["slurm", "--config", RECIPE, "--workdir", str(tmp_path), "--inference-nodes", "2",
                 "--training-nodes", "2",
                 "--gpus-per-node", "4", "--corpus", "/data/corpus.jsonl", "--sglang-args", "--tp 4",
                 "--partition", "gpu", "--time", "24:00:00", "--dry-run", *BASE, "schedule.total_steps=7"])
    script = capsys.readouterr().out
    assert code == 0, script
    # one het group per node: retrieval, 2 SGLang servers, the router, 2 trainer nodes
    assert script.count("#SBATCH hetjob") == 5
    assert "--partition=gpu --time=24:00:00" in script
    steps = [line for line in script.splitlines() if "sorl_megatron.cluster exec" in line]
    assert len(steps) == 6
    retrieval, *rest = steps
    servers, router, trainers = rest[:2], rest[2], rest[3:]
    assert "sorl_megatron.retrieval.server --corpus /data/corpus.jsonl" in retrieval
    for server in servers:
        assert (".venv-sglang/bin/python -m sglang.launch_server --model-path /models/policy --host 0.0.0.0 "
                "--port 30000 --tp 4") in server
        assert "--gpus-per-task=4" not in server  # (resources: #SBATCH lines)
    assert "--wait 'http://{het:1}:30000' --wait 'http://{het:2}:30000'" in router  # starts once both answer
    assert "sorl_megatron.rollout.router --worker-urls 'http://{het:1}:30000' 'http://{het:2}:30000'" in router
    for trainer in trainers:
        assert "--wait 'http://{het:3}:30100' --wait 'http://{het:0}:8000'" in trainer
        assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint '{het:4}:29500'" in trainer
        for override in ["schedule.total_steps=7", "rollout.fleet.router=sglang_router",
                         "'rollout.fleet.router_url=http://{het:3}:30100'",
                         "'rollout.urls=[http://{het:1}:30000,http://{het:2}:30000]'",
                         "'retrieval.url=http://{het:0}:8000'"]:
            assert override in trainer, override
    assert "SORL_ROLLOUT_API_KEY" not in script  # keys travel in the environment, not the script


def _roles(job: FleetJob) -> dict:
    return {role.name: role for role in job.app().roles}


def test_a_server_spanning_nodes_is_rendered_per_node(tmp_path):
    """DeepSeek-V3's FP8 servers need two 8-GPU nodes each: four inference nodes are two servers,
    each node started with SGLang's --nnodes/--node-rank and the server's first node as rendezvous;
    only first nodes serve HTTP, so only they are workers."""
    pytest.importorskip("torchx")
    sglang_env(tmp_path)
    job = FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path), inference_nodes=4, nodes_per_server=2,
                   sglang_args="--tp 16")
    roles = _roles(job)
    commands = [roles[f"rollout{i}"].args for i in range(4)]
    for i, args in enumerate(commands):
        tail = args[args.index("--tp"):]
        first = 1 + 2 * (i // 2)
        assert tail == ["--tp", "16", "--nnodes", "2", "--node-rank", str(i % 2), "--dist-init-addr",
                        f"{{het:{first}}}:20000"], tail
    assert job.worker_urls == ["http://{het:1}:30000", "http://{het:3}:30000"]
    router = roles["router"].args
    assert all(u in router for u in job.worker_urls) and "http://{het:2}:30000" not in router
    with pytest.raises(ConfigError, match=r"--inference-nodes 3 is not a multiple of --nodes-per-server 2"):
        FleetJob(RECIPE, BASE, corpus="/c", workdir=str(tmp_path), inference_nodes=3, nodes_per_server=2).validate()


def test_the_socket_interface_reaches_nccl_and_gloo_in_every_role(tmp_path):
    pytest.importorskip("torchx")
    sglang_env(tmp_path)
    job = FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path), socket_ifname="ib0")
    for role in _roles(job).values():
        assert role.env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}, role.name
    assert all(not r.env for r in _roles(FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path))).values())


FP8_RECIPE = str(ROOT / "recipes" / "tiny_search_r3_fp8.yaml")


def test_the_servers_launch_line_meets_the_trainers_server_checks(tmp_path):
    """What the trainer would refuse at its first sync is refused before the job is rendered."""
    sglang_env(tmp_path)
    Job = functools.partial(FleetJob, corpus="/c.jsonl", workdir=str(tmp_path))
    for job, match in [
        (Job(RECIPE, BASE, sglang_args="--tp 4 --quantization fp8"), r"quantizes a BF16 checkpoint online"),
        (Job(RECIPE, BASE, sglang_args="--skip-tokenizer-init"), r"--skip-tokenizer-init"),
        (Job(RECIPE, BASE, sglang_args="--model-path /x"), r"sets --model-path, which the launcher sets"),
        (Job(RECIPE, BASE, sglang_args="--nnodes 2"), r"sets --nnodes"),
        (Job(FP8_RECIPE, BASE, sglang_args="--enable-return-routed-experts"), r"--server-model-path <dir>"),
        (Job(FP8_RECIPE, BASE, server_model_path="/models/policy-fp8"), r"--enable-return-routed-experts"),
        (Job(RECIPE, BASE, router_policy="power_of_two"), r"/get_load"),
    ]:
        with pytest.raises(ConfigError, match=match):
            job.validate()
    fp8 = Job(FP8_RECIPE, BASE, server_model_path="/models/policy-fp8", sglang_args="--enable-return-routed-experts")
    fp8.validate()


def test_job_is_checked_before_rendering(tmp_path):
    with pytest.raises(ConfigError, match=r"--server-python .venv-sglang/bin/python: .*`make sglang-env`"):
        FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path)).validate()
    sglang_env(tmp_path)
    FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path)).validate()  # found in the job's directory
    with pytest.raises(ConfigError, match=r"--server-python /nowhere/python: /nowhere/python does not exist"):
        FleetJob(RECIPE, BASE, corpus="/c.jsonl", server_python="/nowhere/python").validate()
    Job = functools.partial(FleetJob, workdir=str(tmp_path))
    ok = Job(RECIPE, BASE, corpus="/c.jsonl")
    cfg, overrides = ok.validate()
    assert cfg.rollout.fleet.router == "sglang_router" and len(cfg.rollout.urls) == 1
    for job, match in [
        (Job(RECIPE, BASE), r"give --corpus .* or the override retrieval.url"),
        (Job(RECIPE, BASE, corpus="/c", inference_nodes=0), r"--inference-nodes must be >= 1"),
        (Job(RECIPE, [*BASE, "rollout.urls=[http://a:1]"], corpus="/c"), r"\['rollout.urls'\] are set by the job"),
        (Job(RECIPE, [*BASE, "rollout.groupsize=4"], corpus="/c"), r"rollout.groupsize \(did you mean"),
        (Job(RECIPE, BASE, corpus="/c", wait_timeout_s=0), r"--wait-timeout-s must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            job.validate()
    # an external retrieval server instead of one in the job
    cfg, _ = Job(RECIPE, [*BASE, "retrieval.url=http://search:8000"]).validate()
    assert cfg.retrieval.url == "http://search:8000"


def test_hosts_come_from_the_het_groups():
    env = {"SLURM_JOB_NODELIST_HET_GROUP_0": "cpu7", "SLURM_JOB_NODELIST_HET_GROUP_3": "gpu12"}
    assert resolve_hosts(["http://{het:0}:8000", "x", "{het:3}:29500"], env) == ["http://cpu7:8000", "x",
                                                                                 "gpu12:29500"]
    with pytest.raises(SystemExit, match="SLURM_JOB_NODELIST_HET_GROUP_1 is not set"):
        resolve_hosts(["{het:1}"], env)
    with pytest.raises(SystemExit, match=r"lists several nodes"):
        resolve_hosts(["{het:0}"], {"SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[1-2]"})


def test_exec_waits_for_the_servers_then_runs_the_command(tmp_path):
    """The step a node runs: hosts filled in, a server waited for, then the command itself
    (exec'ed: its output and exit code are the step's)."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_JOB_NODELIST_HET_GROUP_0": "127.0.0.1"}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "sorl_megatron.cluster", "exec", "--wait-timeout-s", "30",
             "--wait", f"http://{{het:0}}:{server.port}", "--", sys.executable, "-c",
             "import sys; print('serving at', sys.argv[1]); sys.exit(3)", "{het:0}:1"],
            capture_output=True, text=True, env=env, timeout=120)
    finally:
        server.stop()
    assert out.returncode == 3, out.stderr
    assert "serving at 127.0.0.1:1" in out.stdout
    # nothing answers: the wait is bounded and says what it waited for
    out = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.cluster", "exec", "--wait-timeout-s", "1", "--wait",
         "http://{het:0}:9", "--", "true"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "http://127.0.0.1:9/health did not answer 200 within 1 s" in out.stderr


def test_a_dry_run_renders_without_sglangs_environment_and_says_what_submitting_needs(capsys, tmp_path):
    """Issue 48: ``--dry-run`` is how a newcomer reads the job before building anything; it
    renders without ``.venv-sglang/`` and names `make sglang-env` in one note, where a
    submission is refused."""
    pytest.importorskip("torchx")
    code = main(["slurm", "--config", RECIPE, "--workdir", str(tmp_path), "--corpus", "/data/corpus.jsonl",
                 "--dry-run", *BASE])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "sglang.launch_server" in out
    assert "note: submitting this job would be refused: --server-python .venv-sglang/bin/python" in err
    assert "`make sglang-env`" in err
    with pytest.raises(ConfigError, match=r"`make sglang-env`"):
        FleetJob(RECIPE, BASE, corpus="/c.jsonl", workdir=str(tmp_path)).validate()
