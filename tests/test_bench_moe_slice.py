"""benchmarks/bench_moe_slice.py's CPU half: the narrow stand-in of the Qwen3-30B-A3B slice runs
the update, the log-prob pass and the split with the experts grouped and looped (no timing is
asserted), and the grouped mode does reach ``torch._grouped_mm`` through the layer spec."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("update", "logprob", "attention", "router+dispatch", "experts", "logits+loss")


def test_the_small_slice_runs_and_prints_the_split():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe_slice.py"), "--small", "--reps", "1"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "layer spec local" in out and "tokens=256" in out, out
    calls = dict(re.findall(r"expert GEMM (\w+) \(torch._grouped_mm calls: (\d+)\)", out))
    assert set(calls) == {"grouped", "loop"}, out
    assert int(calls["grouped"]) > 0 and int(calls["loop"]) == 0, out
    for part in PARTS:
        rows = re.findall(rf"^  {re.escape(part)}\s+([\d.]+)\s+(\d+)\s+([\d.]+)$", out, re.M)
        assert len(rows) == 2 and all(float(ms) > 0 for ms, _, _ in rows), (part, out)
