"""The trainer and its SGLang servers must run the same NCCL: a weight-update group joins ranks of
both, and NCCL versions that differ can hang or fail the first broadcast. Both environments take
NCCL from torch's wheel (the SGLang environment pins the trainer's torch: requirements-sglang.txt),
so where NCCL itself cannot be read (a CPU-only torch on a login node) the torch releases are
compared instead. Checked by the Slurm launcher before it renders a job and by ``make sglang-env``:

    python -m sorl_megatron.common.nccl_match .venv-sglang/bin/python
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Optional

PROBE = """
import json, torch
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:
    nccl = None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}))
"""


class NcclMismatchError(RuntimeError):
    """The two environments' NCCL (or torch, where NCCL cannot be read) differ, or one cannot be read."""


def runtime_of(python: Optional[str] = None, timeout_s: float = 120.0) -> dict:
    """torch, CUDA and NCCL versions of ``python`` (None: this interpreter, read in place)."""
    if python is None:
        import torch

        try:
            nccl: Optional[str] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a CPU-only build
            nccl = None
        return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}
    stat = os.stat(python) if os.path.exists(python) else None
    return _probe(python, stat.st_mtime_ns if stat else 0, timeout_s)


@functools.lru_cache(maxsize=16)
def _probe(python: str, mtime_ns: int, timeout_s: float) -> dict:
    """``python``'s versions, read once per interpreter file (as it is on disk)."""
    cmd = [python, "-c", PROBE]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NcclMismatchError(f"cannot run {cmd[0]} to read its torch and NCCL versions: {err}") from None
    line = (out.stdout.strip().splitlines() or [""])[-1]
    try:
        found = json.loads(line)
    except ValueError:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise NcclMismatchError(f"{cmd[0]} did not report its torch and NCCL versions (exit {out.returncode}): "
                                f"{tail}") from None
    return found if isinstance(found, dict) else {}


def _release(torch_version: Optional[str]) -> str:
    return str(torch_version or "unknown").split("+", 1)[0]


def mismatch(trainer: dict, server: dict, server_python: str) -> Optional[str]:
    """One line naming both versions where they differ; None where they agree."""
    if trainer.get("nccl") and server.get("nccl"):
        if trainer["nccl"] != server["nccl"]:
            return (f"NCCL {trainer['nccl']} in the trainer's environment (torch {trainer.get('torch')}) but NCCL "
                    f"{server['nccl']} in the SGLang environment {server_python} (torch {server.get('torch')}): a "
                    "weight-update group needs one NCCL; install the trainer's torch pin in both (make sglang-env)")
        return None
    if _release(trainer.get("torch")) != _release(server.get("torch")):
        return (f"torch {trainer.get('torch')} in the trainer's environment but torch {server.get('torch')} in the "
                f"SGLang environment {server_python}: each takes NCCL from its torch wheel, and a weight-update "
                "group needs one NCCL; install the trainer's torch pin in both (make sglang-env)")
    return None


def check(server_python: str, timeout_s: float = 120.0) -> str:
    """The line that says both agree; :class:`NcclMismatchError` naming both where they do not."""
    trainer, server = runtime_of(None, timeout_s), runtime_of(server_python, timeout_s)
    problem = mismatch(trainer, server, server_python)
    if problem:
        raise NcclMismatchError(problem)
    both = trainer.get("nccl") and server.get("nccl")
    what = f"NCCL {server['nccl']}" if both else f"torch {_release(server.get('torch'))}"
    return f"the trainer and {server_python} agree: {what}"


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sorl_megatron.common.nccl_match", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("server_python", help="the SGLang environment's interpreter, e.g. .venv-sglang/bin/python")
    args = parser.parse_args(argv)
    try:
        print(check(args.server_python))
    except NcclMismatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
