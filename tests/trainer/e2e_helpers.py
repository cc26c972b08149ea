"""Shared pieces of the end-to-end trainer tests: the tiny data set, the shared embedded servers,
the tiny-run overrides, metrics reading, clean environments for subprocess launches, and
process liveness checks (no psutil)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_RECIPE = str(ROOT / "recipes" / "tiny_search_base.yaml")
VENV_BIN = os.path.dirname(sys.executable)

# Prompts of the synthetic set are ~105 tokens with the generated tokenizer: leave room for
# two short turns (a budget below the prompt length would give empty trajectories).
TINY = [
    "schedule.batch_size=2",
    "rollout.group_size=2",
    "schedule.mini_batch_size=2",  # 4 trajectories -> 2 optimizer steps (the second is off-policy)
    "schedule.micro_batch_size=1",
    "rollout.max_turns=2",
    "rollout.max_turn_tokens=12",
    "rollout.max_total_tokens=340",
    "rollout.max_obs_tokens=32",
    "sft.enabled=false",
    "schedule.val_every=0",
    "data.val=",  # null: no validation
    "optimizer.lr=1e-2",  # large enough that the off-policy mini-batch clips
    "optimizer.critic_lr=1e-2",
    "logging.progress=none",
    "logging.tensorboard=false",
]


def make_tiny_data(out: Path) -> Path:
    """The synthetic QA set, corpus, tokenizer and tiny Qwen3-MoE (vocab 512, tied) in ``out``."""
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_synthetic_data.py"), "--out", str(out), "--num-people", "8",
         "--make-model", "--vocab-size", "512", "--tie-embeddings"],
        check=True, capture_output=True, env=subprocess_env(), cwd=ROOT,
    )
    return out


@contextlib.contextmanager
def shared_embedded_servers(data: Path, workdir: Path) -> Iterator[dict]:
    """One rollout server (routed experts on, for R3) and one retrieval server that the trainer
    did not start: their API keys reach it as a user's would, by environment variable.
    Yields ``rollout`` / ``retrieval`` URLs, ``keys`` and the ``overrides`` pointing a run at them."""
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, retrieval_server_spec, rollout_server_spec

    servers = EmbeddedServers(workdir)
    with pytest.MonkeyPatch.context() as env:
        try:
            retrieval = servers.start(retrieval_server_spec(str(data / "corpus.jsonl"), 2))
            rollout = servers.start(rollout_server_spec(str(data / "model"), "fp32", True, 1234))
            env.setenv("SORL_RETRIEVAL_API_KEY", servers.api_keys["retrieval"])
            env.setenv("SORL_ROLLOUT_API_KEY", servers.api_keys["rollout"])
            yield {"rollout": rollout, "retrieval": retrieval, "keys": dict(servers.api_keys),
                   "overrides": [f"rollout.urls=[{rollout}]", f"retrieval.url={retrieval}"]}
        finally:
            servers.stop()


def data_overrides(data: Path) -> list[str]:
    return [
        f"model.path={data / 'model'}",
        f"retrieval.corpus={data / 'corpus.jsonl'}",
        f"data.train={data / 'train.parquet'}",
    ]


def run_overrides(data: Path, out: Path, name: str, *extra: str) -> list[str]:
    """Tiny-run overrides writing under ``out/name`` (logs) and ``out/name/ckpt``."""
    return [*data_overrides(data), *TINY, f"logging.dir={out}", f"logging.run_name={name}",
            f"checkpoint.dir={out / name / 'ckpt'}", *extra]


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl of a run as {step: row}."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def comparable(row: dict) -> dict:
    """A metrics row without wall-clock fields."""
    return {k: v for k, v in row.items() if k not in ("time", "step") and not k.startswith("time/")}


def abs_tol(key: str) -> float:
    """How far two runs' logged ``key`` may differ when they trained on the same tokens."""
    # The train/inference mismatch statistics are float noise (|log pi - log mu| ~ 1e-7): the
    # server's batched forward depends on which requests share a batch (timing), so they only
    # agree to ~1e-6 between runs; the sampled tokens, and everything trained on them, are equal.
    # approx_kl is a mean of log-ratio differences ~1e-2 whose last bits depend on the thread
    # count of the process's reductions (in-process pytest vs the CLI subprocess): ~2e-8 apart.
    if key.startswith("actor/is/mismatch"):
        return 5e-6
    return 1e-7 if key.startswith("actor/approx_kl") else 1e-9


def assert_finite(row: dict, what: str) -> None:
    # MetricsLogger writes non-finite values as null
    bad = {k: v for k, v in row.items() if v is None or (isinstance(v, float) and not math.isfinite(v))}
    assert not bad, f"{what}: non-finite metrics {bad}"


def subprocess_env() -> dict:
    """The environment for a child launch: no torch.distributed variables from this process's
    environment (a test run under a launcher, or a test that set them)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _proc_read(path: str) -> bytes | None:
    """A /proc file of a process or thread that may be exiting: None once it is gone (no file, or
    ESRCH while /proc still lists it)."""
    try:
        return Path(path).read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a reaped child raises ProcessLookupError)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): count it as dead only if /proc says so
    after_name = (_proc_read(f"/proc/{pid}/stat") or b"").rsplit(b")", 1)[1:]  # the name may hold spaces
    fields = after_name[0].split() if after_name else []
    return bool(fields) and fields[0] != b"Z"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc), any thread."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in (_proc_read(f"{task}/children") or b"").split()]
    return out


def server_children(pid: int) -> list[int]:
    """Children of ``pid`` that are embedded rollout / retrieval servers."""
    out = []
    for child in children(pid):
        cmd = (_proc_read(f"/proc/{child}/cmdline") or b"").split(b"\0")
        if b"sorl_megatron.sglang_cpu.server" in cmd or b"sorl_megatron.retrieval.server" in cmd:
            out.append(child)
    return out


def wait_dead(pids: Iterable[int], timeout_s: float = 30.0) -> list[int]:
    """Wait until every pid is gone; return the ones still alive at the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    pids = list(pids)
    while time.monotonic() < deadline:
        pids = [p for p in pids if alive(p)]
        if not pids:
            return []
        time.sleep(0.2)
    return pids


@dataclasses.dataclass
class Interrupted:
    """What :func:`ctrl_c_train` saw: the exit code, the output, the embedded servers and the
    child processes at the moment of Ctrl-C, and the children still alive 30 s after it."""

    code: int
    stdout: str
    stderr: str
    servers: list[int]
    left: list[int]


def ctrl_c_train(args: list[str], workdir: Path, ready, what: str, timeout_s: float = 300.0) -> Interrupted:
    """``python -m sorl_megatron.train`` with ``args``, Ctrl-C as a terminal sends it (SIGINT to
    the launch's process group) once ``ready()`` holds; ``what`` names the awaited moment."""
    import signal
    import time

    out_path, err_path = workdir / "stdout.txt", workdir / "stderr.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sorl_megatron.train", "--config", BASE_RECIPE, *args], cwd=ROOT,
            env=subprocess_env(), stdout=out, stderr=err, start_new_session=True,
            # a shell's background job ignores SIGINT and children inherit that: take Python's default
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not ready():
                assert proc.poll() is None, f"the run exited early:\n{err_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"the run did not reach {what}"
                time.sleep(0.1)
            servers, helpers = server_children(proc.pid), children(proc.pid)
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    left = wait_dead(helpers, timeout_s=30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return Interrupted(code, out_path.read_text(), err_path.read_text(), servers, left)
