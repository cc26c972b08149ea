"""Launch helpers: subprocess/torchrun runs of worker.py and the CLI, and result lookup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_command(args: list[str], timeout: int = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc


def torchrun_args(nproc: int) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]


def run_worker(cases: list[dict], models_dir: Path, work_dir: Path, nproc: int, name: str) -> dict:
    """Run worker.py over `cases`; results keyed by each case's "id"."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = work_dir / f"{name}_spec.json"
    out = work_dir / f"{name}_results.json"
    spec.write_text(json.dumps({"models_dir": str(models_dir), "work_dir": str(work_dir), "cases": cases}))
    launcher = [PYTHON] if nproc == 1 else torchrun_args(nproc)
    proc = run_command([*launcher, str(HERE / "worker.py"), str(spec), str(out)], timeout=400)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"worker {name} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    results = json.loads(out.read_text())
    return {r["case"]["id"]: r for r in results}


def result(results: dict, case_id: str) -> dict:
    r = results[case_id]
    assert r["ok"], f"{case_id} raised: {r.get('error')}\n{r.get('traceback', '')}"
    return r
