"""A whole run as one Slurm job, rendered and submitted by TorchX: ``python -m
sorl_megatron.cluster slurm --config RECIPE --inference-nodes N --training-nodes M [--dry-run] [key=value ...]``.

The job is heterogeneous, one group per node (TorchX's Slurm scheduler: one ``hetjob`` group
per role replica), in this order:

- group 0: the retrieval server over ``--corpus`` (CPU; left out with ``retrieval.url=...``);
- groups 1..N: the SGLang servers on the N inference nodes (``sglang.launch_server`` with
  ``--sglang-args``), one per node, or one per ``--nodes-per-server`` nodes for a model that does
  not fit one node (SGLang's ``--nnodes``/``--node-rank``/``--dist-init-addr``, rendezvous on the
  server's first node, which alone serves HTTP); run by ``--server-python``: SGLang's own
  environment, ``.venv-sglang/`` (``make sglang-env``; SGLang pins a transformers other than the
  trainer's, so it cannot live in the trainer's environment, and the torch both share, for NCCL's
  sake). They load ``--server-model-path`` (default ``model.path``; for ``rollout.precision: fp8``
  an FP8-serialized export, required). The launch line is checked against the trainer's own
  server checks (``rollout/launch_check.py``) before anything is rendered;
- group N+1: ``sglang-router`` in front of them (CPU), ``--router-policy``;
- the last M groups: ``torchrun`` on the training nodes (c10d rendezvous on the first of
  them), with the recipe and its overrides plus the fleet's ``rollout.urls``,
  ``rollout.fleet.router_url`` and ``retrieval.url``.

Host names are known only when Slurm places the job, so every command runs through
``python -m sorl_megatron.cluster exec [--wait URL ...] -- CMD``, which replaces ``{het:K}``
in CMD by the host of group K (``$SLURM_JOB_NODELIST_HET_GROUP_K``), waits (bounded by
``--wait-timeout-s``) until each ``--wait`` URL answers ``/health``, then runs CMD in its
place. The recipe, with the fleet's keys, is validated before anything is rendered. With
``--socket-ifname`` every role exports ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` (megatron
builds a gloo group beside every NCCL one; without it gloo may bind an interface the other nodes
cannot reach). API keys
reach the servers, the router and the trainer through the submitting shell's environment
(``SORL_ROLLOUT_API_KEY``, ``SORL_RETRIEVAL_API_KEY``; srun exports it), never the script.
TorchX is an optional dependency: ``pip install -e '.[cluster]'``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .common import nccl_match
from .common.cli_range import WEEK, count, seconds
from .common.typed_config import ConfigError
from .trainer.recipe.loader import load_recipe
from .trainer.recipe.rollout_config import FleetConfig

_HET = re.compile(r"\{het:(\d+)\}")
RETRIEVAL_PORT, SGLANG_PORT, ROUTER_PORT, RDZV_PORT, SGLANG_DIST_PORT = 8000, 30000, 30100, 29500, 20000
# the sglang-router policies the recipe allows (rollout.fleet.router_policy: not power_of_two,
# which polls each worker's /get_load, gone in SGLang 0.5.21; tests/test_launch_lines.py reads both)
ROUTER_POLICIES = typing.get_args(typing.get_type_hints(FleetConfig)["router_policy"])
SET_BY_LAUNCHER = ("--nnodes", "--node-rank", "--dist-init-addr", "--model-path", "--host", "--port")
SGLANG_PYTHON = ".venv-sglang/bin/python"  # what `make sglang-env` builds (requirements-sglang.txt)


@dataclass
class FleetJob:
    """What to run where (see the module doc)."""

    config: str
    overrides: list[str] = field(default_factory=list)
    inference_nodes: int = 1
    training_nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_node: int = 32
    mem_mb_per_node: int = 512_000
    sglang_args: str = ""
    corpus: Optional[str] = None  # the retrieval server's corpus; None: retrieval.url is in the overrides
    retrieval_topk: int = 3
    router_policy: str = "cache_aware"
    workdir: str = "."  # the job's working directory on the shared file system (TorchX's Slurm "image")
    wait_timeout_s: float = 1800.0  # the longest wait of a command for the servers it needs
    server_python: str = SGLANG_PYTHON  # the SGLang servers' interpreter; relative: to workdir
    server_model_path: Optional[str] = None  # what the servers load (default model.path)
    nodes_per_server: int = 1  # nodes one SGLang server spans (multi-node TP/EP serving)
    socket_ifname: Optional[str] = None  # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME of every role
    # a submitted job needs the interpreter; a dry run only renders the job, so it renders
    # without it and says what submitting would need (missing_server_python)
    require_server_python: bool = True

    def missing_server_python(self) -> str:
        """Why the servers' interpreter is not there ("" when it is)."""
        python = Path(self.workdir) / self.server_python  # an absolute server_python stays as it is
        if python.is_file():
            return ""
        return (f"--server-python {self.server_python}: {python} does not exist. SGLang runs in its own environment: "
                f"build it with `make sglang-env` in {self.workdir} (it makes {SGLANG_PYTHON}), or pass "
                "--server-python with the interpreter of an environment that has SGLang")

    def validate(self):
        """The trainer's recipe and overrides (the fleet's keys added), checked against the
        recipe schema with stand-in host names; errors name the flag or key."""
        for name in ("inference_nodes", "training_nodes", "gpus_per_node", "cpus_per_node", "mem_mb_per_node",
                     "nodes_per_server"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.inference_nodes % self.nodes_per_server:
            raise ConfigError(f"--inference-nodes {self.inference_nodes} is not a multiple of --nodes-per-server "
                              f"{self.nodes_per_server} (each server spans that many whole nodes)")
        if self.router_policy not in ROUTER_POLICIES:
            raise ConfigError(f"--router-policy {self.router_policy}: choose one of {', '.join(ROUTER_POLICIES)} "
                              "(power_of_two polls /get_load, which SGLang 0.5.21 does not serve)")
        if not self.wait_timeout_s > 0:
            raise ConfigError(f"--wait-timeout-s must be > 0, got {self.wait_timeout_s}")
        missing = self.missing_server_python()
        if missing and self.require_server_python:
            raise ConfigError(missing)
        if not missing:  # one NCCL in both environments: the weight-update groups join ranks of each
            try:
                python = str(Path(self.workdir) / self.server_python)
                nccl_match.check(python, timeout_s=min(self.wait_timeout_s, 300.0))
            except nccl_match.NcclMismatchError as err:
                raise ConfigError(f"--server-python {self.server_python}: {err}") from None
        given = {o.split("=", 1)[0].lstrip("+") for o in self.overrides}
        if self.corpus is None and "retrieval.url" not in given:
            raise ConfigError("give --corpus (a retrieval server in the job) or the override retrieval.url=...")
        fleet = ["rollout.fleet.router=sglang_router", f"rollout.fleet.router_url={self.router_url}",
                 f"rollout.urls=[{','.join(self.worker_urls)}]"]
        if self.corpus is not None:
            fleet.append(f"retrieval.url=http://{{het:0}}:{RETRIEVAL_PORT}")
        clash = sorted(given & {o.split("=", 1)[0] for o in fleet})
        if clash:
            raise ConfigError(f"overrides {clash} are set by the job itself (its own servers and router)")
        trainer = [*self.overrides, *fleet]
        cfg = load_recipe(self.config, [_placeholder_hosts(o) for o in trainer])
        self._check_launch_line(cfg)
        return cfg, trainer

    def _check_launch_line(self, cfg) -> None:
        """The servers' flags against the trainer's own server checks, before anything runs."""
        from .rollout.launch_check import launch_line_problem
        from .rollout.server_facts import checkpoint_quantization

        args = shlex.split(self.sglang_args)
        taken = sorted({a.split("=", 1)[0] for a in args} & set(SET_BY_LAUNCHER))
        if taken:
            raise ConfigError(f"--sglang-args sets {', '.join(taken)}, which the launcher sets itself "
                              "(--server-model-path, --nodes-per-server)")
        fp8 = cfg.rollout.precision == "fp8"
        path = self.server_model_path or cfg.model.path
        if fp8 and self.server_model_path in (None, cfg.model.path):
            raise ConfigError(
                "rollout.precision is fp8: the servers must load an FP8-serialized export of the policy, made with "
                f"`python tools/convert.py megatron-to-hf --hf {cfg.model.path} --out <dir> --fp8`; pass it as "
                "--server-model-path <dir> (SGLang's --quantization fp8 on the BF16 checkpoint quantizes online, "
                "into a layout a weight sync cannot write)")
        found = checkpoint_quantization(path)  # readable from here (a shared file system): what it holds
        served = found if found is not False else (_FP8_EXPORT if fp8 else None)
        problem = launch_line_problem(["--model-path", path, *args], cfg.rollout.precision,
                                      cfg.algorithm.routing_replay == "r3", served)
        if problem:
            raise ConfigError(f"--sglang-args: {problem}")

    @property
    def worker_urls(self) -> list[str]:
        """Each server's first node: the one that serves HTTP."""
        return [f"http://{{het:{1 + i}}}:{SGLANG_PORT}" for i in range(0, self.inference_nodes, self.nodes_per_server)]

    def server_command(self, node: int, model: str) -> list[str]:
        """SGLang on inference node ``node`` (0-based): a whole server, or one node of one."""
        command = [self.server_python, "-m", "sglang.launch_server", "--model-path", model,
                   "--host", "0.0.0.0", "--port", str(SGLANG_PORT), *shlex.split(self.sglang_args)]
        if self.nodes_per_server > 1:
            first = 1 + node - node % self.nodes_per_server
            command += ["--nnodes", str(self.nodes_per_server), "--node-rank", str(node % self.nodes_per_server),
                        "--dist-init-addr", f"{{het:{first}}}:{SGLANG_DIST_PORT}"]
        return command

    @property
    def router_url(self) -> str:
        return f"http://{{het:{1 + self.inference_nodes}}}:{ROUTER_PORT}"

    def app(self):
        """The TorchX AppDef of the job."""
        from torchx import specs

        cfg, trainer_overrides = self.validate()
        gpu = specs.Resource(cpu=self.cpus_per_node, gpu=self.gpus_per_node, memMB=self.mem_mb_per_node)
        cpu = specs.Resource(cpu=min(8, self.cpus_per_node), gpu=0, memMB=min(64_000, self.mem_mb_per_node))
        wait = ["--wait-timeout-s", f"{self.wait_timeout_s:g}"]

        def role(name: str, command: list[str], resource, waits: Sequence[str] = (), replicas: int = 1):
            args = ["-m", "sorl_megatron.cluster", "exec", *wait, *(a for u in waits for a in ("--wait", u)), "--",
                    *command]
            env = {} if self.socket_ifname is None else {"NCCL_SOCKET_IFNAME": self.socket_ifname,
                                                          "GLOO_SOCKET_IFNAME": self.socket_ifname}
            return specs.Role(name=name, image=self.workdir, entrypoint="python", args=args, num_replicas=replicas,
                              resource=resource, env=env)

        roles = []
        if self.corpus is not None:
            roles.append(role("retrieval", ["python", "-m", "sorl_megatron.retrieval.server", "--corpus", self.corpus,
                                            "--topk", str(self.retrieval_topk), "--host", "0.0.0.0",
                                            "--port", str(RETRIEVAL_PORT)], cpu))
        model = self.server_model_path or cfg.model.path
        for i in range(self.inference_nodes):  # one role each: its own het group, its own host
            roles.append(role(f"rollout{i}", self.server_command(i, model), gpu))
        roles.append(role("router", ["python", "-m", "sorl_megatron.rollout.router", "--worker-urls",
                                     *self.worker_urls, "--policy", self.router_policy, "--host", "0.0.0.0",
                                     "--port", str(ROUTER_PORT)], cpu, waits=self.worker_urls))
        first_trainer = len(roles)
        needs = [self.router_url] + ([f"http://{{het:0}}:{RETRIEVAL_PORT}"] if self.corpus is not None else [])
        for i in range(self.training_nodes):
            roles.append(role(f"trainer{i}", [
                "torchrun", "--nnodes", str(self.training_nodes), "--nproc-per-node", str(self.gpus_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{{het:{first_trainer}}}:{RDZV_PORT}",
                "--rdzv-id", "sorl", "-m", "sorl_megatron.train", "--config", self.config, *trainer_overrides,
            ], gpu, waits=needs))
        return specs.AppDef(name="sorl", roles=roles)


_FP8_EXPORT = {"quant_method": "fp8", "weight_block_size": [128, 128]}  # what convert.py --fp8 writes


def _placeholder_hosts(text: str) -> str:
    return _HET.sub(lambda m: f"het-group-{m.group(1)}", text)


def resolve_hosts(words: Sequence[str], env: Optional[dict] = None) -> list[str]:
    """``{het:K}`` -> the host of Slurm het group K (one node per group)."""
    env = os.environ if env is None else env

    def host(m: re.Match) -> str:
        var = f"SLURM_JOB_NODELIST_HET_GROUP_{m.group(1)}"
        nodes = env.get(var)
        if not nodes:
            raise SystemExit(f"{var} is not set: run inside the heterogeneous Slurm job this module renders")
        if any(c in nodes for c in ",[]"):
            raise SystemExit(f"{var}={nodes!r} lists several nodes; each group of this job is one node")
        return nodes

    return [_HET.sub(host, w) for w in words]


def _exec(args: argparse.Namespace) -> int:
    from .common.background import wait_healthy

    command = resolve_hosts(args.command)
    for url in resolve_hosts(args.wait):
        print(f"waiting for {url}/health (at most {args.wait_timeout_s:g} s)", flush=True)
        wait_healthy(url, timeout_s=args.wait_timeout_s)
    if not command:
        raise SystemExit("exec: no command after --")
    os.execvp(command[0], command)
    return 1  # not reached


def _slurm(args: argparse.Namespace) -> int:
    job = FleetJob(
        config=args.config, overrides=list(args.overrides), inference_nodes=args.inference_nodes,
        training_nodes=args.training_nodes, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
        mem_mb_per_node=args.mem_mb_per_node, sglang_args=args.sglang_args, corpus=args.corpus,
        router_policy=args.router_policy, workdir=args.workdir, wait_timeout_s=args.wait_timeout_s,
        server_python=args.server_python, server_model_path=args.server_model_path,
        nodes_per_server=args.nodes_per_server, socket_ifname=args.socket_ifname,
        require_server_python=not args.dry_run)
    try:
        from torchx.schedulers.slurm_scheduler import create_scheduler
    except ImportError:
        print("the slurm launcher needs TorchX: pip install -e '.[cluster]'", file=sys.stderr)
        return 2
    try:
        app = job.app()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    scheduler = create_scheduler("sorl")
    cfg = {k: v for k, v in (("partition", args.partition), ("time", args.time)) if v}
    info = scheduler.submit_dryrun(app, cfg)
    if args.dry_run:
        print(info.request.materialize())
        if missing := job.missing_server_python():
            print(f"note: submitting this job would be refused: {missing}", file=sys.stderr)
        return 0
    print(f"submitted: {scheduler.schedule(info)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sorl_megatron.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("slurm", help="render (--dry-run) or submit the run as one heterogeneous Slurm job")
    s.add_argument("--config", required=True, help="the training recipe")
    s.add_argument("--inference-nodes", type=count(1, 4096), default=1,
                   help="nodes for the SGLang servers, one server per --nodes-per-server of them (default 1)")
    s.add_argument("--nodes-per-server", type=count(1, 64), default=1,
                   help="nodes one SGLang server spans, for a model that does not fit one node (default 1)")
    s.add_argument("--training-nodes", type=count(1, 4096), default=1, help="torchrun nodes (default 1)")
    s.add_argument("--gpus-per-node", type=count(1, 64), default=8, help="GPUs per node, every component (default 8)")
    s.add_argument("--cpus-per-node", type=count(1, 4096), default=32,
                   help="CPUs per node, every component (default 32)")
    s.add_argument("--mem-mb-per-node", type=count(1, 1 << 26), default=512_000,
                   help="memory per node in MB (default 512000)")
    s.add_argument("--sglang-args", default="",
                   help="flags of sglang.launch_server, e.g. '--tp 8 --enable-return-routed-experts' (no "
                        "--quantization: FP8 rollouts serve an FP8 export, --server-model-path)")
    s.add_argument("--server-model-path", default=None,
                   help="the checkpoint the servers load (default model.path); with rollout.precision fp8 the FP8 "
                        "export of `tools/convert.py megatron-to-hf --fp8`")
    s.add_argument("--socket-ifname", default=None,
                   help="network interface for NCCL and gloo (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME)")
    s.add_argument("--server-python", default=SGLANG_PYTHON,
                   help=f"the SGLang servers' Python, relative to --workdir unless absolute (default {SGLANG_PYTHON}, "
                        "made by `make sglang-env`)")
    s.add_argument("--corpus", default=None, help="the retrieval server's JSONL corpus (else override retrieval.url)")
    s.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="sglang-router's --policy (default cache_aware: an episode's turns stay with its prefix)")
    s.add_argument("--workdir", default=".", help="the job's directory on the shared file system (default .)")
    s.add_argument("--wait-timeout-s", type=seconds(WEEK), default=1800.0, help="longest wait for the servers (1800)")
    s.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    s.add_argument("--time", default=None, help="Slurm time limit, e.g. 24:00:00")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    s.add_argument("overrides", nargs="*", help="the trainer's dotted overrides")
    e = sub.add_parser("exec", help="(inside the job) fill in the hosts, wait for servers, run a command")
    e.add_argument("--wait", action="append", default=[], help="a URL whose /health must answer first")
    e.add_argument("--wait-timeout-s", type=seconds(WEEK), default=1800.0,
                   help="longest wait for each --wait URL (1800)")
    e.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "exec":
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return _exec(args)
    return _slurm(args)


if __name__ == "__main__":
    raise SystemExit(main())
