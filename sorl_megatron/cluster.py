"""A whole run as one Slurm job, rendered and submitted by TorchX: ``python -m
sorl_megatron.cluster slurm --config RECIPE --inference-nodes N --training-nodes M [--dry-run] [key=value ...]``.

The job is heterogeneous, one group per node (TorchX's Slurm scheduler: one ``hetjob`` group
per role replica), in this order:

- group 0: the retrieval server over ``--corpus`` (CPU; left out with ``retrieval.url=...``);
- groups 1..N: one SGLang server per inference node (``sglang.launch_server`` with
  ``--sglang-args``), run by ``--server-python``: SGLang's own environment, ``.venv-sglang/``
  (``make sglang-env``; SGLang pins a transformers other than the trainer's, so it cannot live
  in the trainer's environment, and the torch both share, for NCCL's sake);
- group N+1: ``sglang-router`` in front of them (CPU), ``--router-policy``;
- the last M groups: ``torchrun`` on the training nodes (c10d rendezvous on the first of
  them), with the recipe and its overrides plus the fleet's ``rollout.urls``,
  ``rollout.fleet.router_url`` and ``retrieval.url``.

Host names are known only when Slurm places the job, so every command runs through
``python -m sorl_megatron.cluster exec [--wait URL ...] -- CMD``, which replaces ``{het:K}``
in CMD by the host of group K (``$SLURM_JOB_NODELIST_HET_GROUP_K``), waits (bounded by
``--wait-timeout-s``) until each ``--wait`` URL answers ``/health``, then runs CMD in its
place. The recipe, with the fleet's keys, is validated before anything is rendered. API keys
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .common.typed_config import ConfigError
from .trainer.recipe.loader import load_recipe

_HET = re.compile(r"\{het:(\d+)\}")
RETRIEVAL_PORT, SGLANG_PORT, ROUTER_PORT, RDZV_PORT = 8000, 30000, 30100, 29500
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
        for name in ("inference_nodes", "training_nodes", "gpus_per_node", "cpus_per_node", "mem_mb_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.wait_timeout_s > 0:
            raise ConfigError(f"--wait-timeout-s must be > 0, got {self.wait_timeout_s}")
        missing = self.missing_server_python()
        if missing and self.require_server_python:
            raise ConfigError(missing)
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
        return load_recipe(self.config, [_placeholder_hosts(o) for o in trainer]), trainer

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://{{het:{1 + i}}}:{SGLANG_PORT}" for i in range(self.inference_nodes)]

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
            return specs.Role(name=name, image=self.workdir, entrypoint="python", args=args, num_replicas=replicas,
                              resource=resource)

        roles = []
        if self.corpus is not None:
            roles.append(role("retrieval", ["python", "-m", "sorl_megatron.retrieval.server", "--corpus", self.corpus,
                                            "--topk", str(self.retrieval_topk), "--host", "0.0.0.0",
                                            "--port", str(RETRIEVAL_PORT)], cpu))
        model = cfg.model.path
        for i in range(self.inference_nodes):  # one role each: its own het group, its own host
            roles.append(role(f"rollout{i}", [self.server_python, "-m", "sglang.launch_server", "--model-path", model,
                                              "--host", "0.0.0.0", "--port", str(SGLANG_PORT),
                                              *shlex.split(self.sglang_args)], gpu))
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
        server_python=args.server_python, require_server_python=not args.dry_run)
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
    s.add_argument("--inference-nodes", type=int, default=1, help="SGLang servers, one per node (default 1)")
    s.add_argument("--training-nodes", type=int, default=1, help="torchrun nodes (default 1)")
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, every component (default 8)")
    s.add_argument("--cpus-per-node", type=int, default=32, help="CPUs per node, every component (default 32)")
    s.add_argument("--mem-mb-per-node", type=int, default=512_000, help="memory per node in MB (default 512000)")
    s.add_argument("--sglang-args", default="", help="flags of sglang.launch_server, e.g. '--tp 8 --quantization fp8'")
    s.add_argument("--server-python", default=SGLANG_PYTHON,
                   help=f"the SGLang servers' Python, relative to --workdir unless absolute (default {SGLANG_PYTHON}, "
                        "made by `make sglang-env`)")
    s.add_argument("--corpus", default=None, help="the retrieval server's JSONL corpus (else override retrieval.url)")
    s.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "round_robin", "power_of_two"],
                   help="sglang-router's --policy (default cache_aware: an episode's turns stay with its prefix)")
    s.add_argument("--workdir", default=".", help="the job's directory on the shared file system (default .)")
    s.add_argument("--wait-timeout-s", type=float, default=1800.0, help="longest wait for the servers (1800)")
    s.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    s.add_argument("--time", default=None, help="Slurm time limit, e.g. 24:00:00")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    s.add_argument("overrides", nargs="*", help="the trainer's dotted overrides")
    e = sub.add_parser("exec", help="(inside the job) fill in the hosts, wait for servers, run a command")
    e.add_argument("--wait", action="append", default=[], help="a URL whose /health must answer first")
    e.add_argument("--wait-timeout-s", type=float, default=1800.0, help="longest wait for each --wait URL (1800)")
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
