"""tools/gpu_check.py: its CPU half passes here, and a missing package is one clear line, not a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_check.py"


def _checks() -> dict:
    """The check table of tools/gpu_check.py (loaded as a module: tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CHECKS


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'kernels'}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~2.5 CPU-minutes; a shared CI machine can stretch that many times over
def test_cpu_checks_pass(tmp_path):
    """Every check that needs no CUDA: the kernels interpreted, the engine on gloo, an RL step
    per weight-sync transport, three under the study's stress injectors, a resume with the
    distributed optimizer, a PPO step with the critic and reference offloaded between passes; FP8 is
    a SKIP without TransformerEngine, the memory plan's and the real-width MoE slice's checks SKIPs
    without CUDA."""
    proc = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--quick", "--jobs", "2", "--timeout", "900",
                           "--work", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=1700)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for name in ("env", "kernel_logprobs", "kernel_segment", "kernel_surrogate", "engine", "rl_step_distributed",
                 "rl_step_tensor", "rl_step_disk", "rl_step_stress", "resume_dist_opt", "rl_step_ppo_offload"):
        assert f"PASS {name}: " in out, out
    assert "fp8_forward: " in out and "FAIL" not in out
    assert "SKIP memory_plan: needs CUDA (it reads the CUDA allocator's peak)" in out, out
    assert "SKIP moe_slice: needs CUDA (a real-width benchmark; tests/test_bench_moe_slice.py runs its CPU half)" in out
    assert "summary: 11 passed, 0 failed, 3 skipped" in out or "summary: 12 passed, 0 failed, 2 skipped" in out, out


def test_a_missing_package_is_one_line_with_the_install_command(tmp_path):
    """``megatron`` found but failing to import (a shadow package on PYTHONPATH): the env check
    names it with the wheels install hint, another check that needs it fails in one line, and
    the exit status says so (``--keep-going``: by default the check stops after the environment)."""
    shadow = tmp_path / "shadow" / "megatron"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('megatron is shadowed for this test')\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path / 'shadow'}{os.pathsep}{env['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--quick", "--only", "env",
                           "--only", "engine", "--keep-going", "--work", str(tmp_path / "work")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "Traceback" not in out + proc.stderr
    line = next(x for x in out.splitlines() if x.strip().startswith("missing megatron.core"))
    assert "megatron is shadowed" in line
    hint = "pip install --no-index --find-links wheels/ --no-deps --ignore-requires-python megatron-core==0.16.1"
    assert hint in line
    assert "FAIL env: 2 package(s) missing: megatron.core, mbridge" in out  # mbridge imports megatron
    assert "FAIL engine: ImportError: megatron is shadowed for this test; missing: megatron.core (install: pip" in out
    assert "summary: 0 passed, 2 failed" in out


def test_cuda_checks_fail_clearly_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(TOOL), "--only", "kernel_surrogate", "--work", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "FAIL kernel_surrogate: no CUDA device is visible (run with --device cpu" in proc.stdout


def _shadowed_megatron(tmp_path) -> dict:
    shadow = tmp_path / "shadow" / "megatron"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('megatron is shadowed for this test')\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path / 'shadow'}{os.pathsep}{env['PYTHONPATH']}"
    return env


def test_a_missing_package_stops_the_check_after_the_environment(tmp_path):
    """Issue 48: the missing packages are listed once, and the checks that would fail the same
    way are not run, one line says so."""
    proc = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--quick", "--work", str(tmp_path / "w")],
                          cwd=ROOT, env=_shadowed_megatron(tmp_path), capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert sum(line.strip().startswith("missing megatron.core") for line in out.splitlines()) == 1, out
    assert "stopped after the environment check: 2 package(s) missing: megatron.core, mbridge" in out, out
    others = len(_checks()) - 1  # every check but the environment's
    assert f"the other {others} check(s) were not run (--keep-going runs them anyway)" in out, out
    assert f"summary: 0 passed, 1 failed, {others} skipped" in out, out


def test_without_a_gpu_the_check_stops_after_the_environment(tmp_path):
    """Issue 48: ``make gpu-check`` on a machine without CUDA says so once, within the
    environment check's time, instead of one "no CUDA device" failure per check."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(TOOL), "--work", str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "PASS env: " in out and "no CUDA device" in out, out
    assert "stopped after the environment check: no CUDA device is visible (run with --device cpu" in out, out
    assert out.count("FAIL") == 0 and f"summary: 1 passed, 0 failed, {len(_checks()) - 1} skipped" in out, out
