"""benchmarks/bench_rowwise.py runs (this tree against itself, few rows and rounds) and reports both
forwards bit-identical: the old-checkout loading and the decode / prefill inputs it builds work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_rowwise_runs_and_finds_the_modes_identical():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rowwise.py"), "--old-src", str(ROOT),
                           "--rows", "3", "--repeats", "1"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("bit-identical") == 2, proc.stdout
    assert "old / this tree:" in proc.stdout


def test_an_old_checkout_without_the_mode_is_named(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rowwise.py"), "--old-src", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0
    assert f"--old-src {tmp_path}: no sorl_megatron/sglang_cpu/rowwise.py there" in proc.stderr
