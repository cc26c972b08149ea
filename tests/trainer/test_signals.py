"""Ctrl-C, SIGTERM and kill -9 at every phase of an RL step (issue 49, item 3): none is lost.

The trainer's command line runs in a subprocess (``signal_driver.py``) that sends the signal
to itself at one point of step 2 of a 2-step run checkpointed every step: inside the health
check's and the rollout's event loops, in the old log-prob pass, the actor update, the weight
sync and the checkpoint. Ctrl-C (also twice, 0.3 s apart) and SIGTERM must stop the run there:
exit code 128 + the signal, one line naming the phase and what a rerun does (as the disk has
it), no traceback; so must a Ctrl-C that the code it lands in absorbs (``SIGINT_SWALLOWED``:
before, asyncio turned it into a cancellation that, once absorbed, was gone, and the run went
on to its last step and exited 0). kill -9 just dies. Then the same command resumes and its steps equal
those of an uninterrupted run.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.rl_loop import RLTrainer

from .e2e_helpers import (
    BASE_RECIPE,
    ROOT,
    abs_tol,
    comparable,
    make_tiny_data,
    read_metrics,
    run_overrides,
    subprocess_env,
)

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("signal_driver.py")
COMMON = ["schedule.total_steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=3"]
POINTS = ["rollout", "health", "generate", "old_logprobs", "update", "weight_sync", "checkpoint"]
CASES = ([(p, "SIGINT") for p in POINTS] + [(p, "SIGTERM") for p in POINTS]
         + [("generate", "SIGINT2"), ("update", "SIGINT2"), ("rollout", "SIGINT_SWALLOWED"),
            ("update", "SIGINT_SWALLOWED")]
         + [(p, "SIGKILL") for p in ("generate", "update", "checkpoint")])


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_data(tmp_path_factory.mktemp("signals_data"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory) -> dict:
    """The run's metrics without a signal (one thread, as the subprocess: same reductions)."""
    out = tmp_path_factory.mktemp("signals_reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        RLTrainer(load_recipe(BASE_RECIPE, run_overrides(tiny_data, out, "full", *COMMON))).run()
    finally:
        torch.set_num_threads(threads)
    return read_metrics(out / "full")


def _saved(ckpt: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit()
                  and (p / "MANIFEST.json").is_file())


@pytest.mark.parametrize("point,sig", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_a_signal_at_every_phase_stops_the_run_and_it_resumes_exactly(tiny_data, uninterrupted, tmp_path, point,
                                                                      sig):
    args = ["--config", BASE_RECIPE, *run_overrides(tiny_data, tmp_path, "run", *COMMON, "logging.progress=none")]
    # its own process group, as a terminal's foreground job: the driver signals the whole group
    proc = subprocess.run([sys.executable, str(DRIVER), point, "2", sig, *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    err = proc.stderr
    assert f"SENT {point} 2" in err, err[-4000:]
    saved = _saved(tmp_path / "run" / "ckpt")
    if sig == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL, err[-4000:]
    else:
        signum = signal.SIGINT if sig.startswith("SIGINT") else signal.SIGTERM
        assert proc.returncode == 128 + signum, f"exit {proc.returncode} (the signal was lost?)\n{err[-4000:]}"
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
        line = err.strip().splitlines()[-1]
        what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        found = re.fullmatch(rf"interrupted \({what}\) during (.+): stopped the run and its servers; run the same "
                             r"command again: RL resumes from step (\d) of 2", line)
        assert found and "step 2" in found.group(1), line
        assert int(found.group(2)) == saved[-1], (line, saved)  # what the disk says
        assert err.count("interrupted (") == 1
    assert saved and saved[-1] in (1, 2)
    # the same command again: it resumes and ends as the uninterrupted run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        RLTrainer(load_recipe(BASE_RECIPE, args[2:])).run()
    finally:
        torch.set_num_threads(threads)
    resumed = read_metrics(tmp_path / "run")
    assert sorted(resumed) == sorted(uninterrupted) == [0, 1, 2]
    for step in (1, 2):
        a, b = comparable(uninterrupted[step]), comparable(resumed[step])
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        diff = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=abs_tol(k))}
        assert not diff, f"step {step} differs from the uninterrupted run: {diff}"
