"""The counts of the tools' command lines are bounded and refused in one line before any work
(issue 49, "Deliver 2", the part for tools/gpu_check.py, tools/convert.py and the study
runner): a 0 or negative count, or one a typo made huge, is argparse's error (exit 2) or
convert's own ``error:`` line, never a traceback or an allocation. (Every numeric flag of every
parser: test_cli_flags.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags,needle", [
    (["--jobs", "0"], "argument --jobs: must be in [1, 64], got 0"),
    (["--reps", "-1"], "argument --reps: must be in [0, 10000], got -1"),
    (["--timeout", "99999999"], "argument --timeout: must be in [0, 86400], got 99999999"),
])
def test_gpu_check_counts(flags, needle):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("parallel", ["0", "-3", "100000"])
def test_study_parallel(parallel, capsys):
    from sorl_megatron.study.runner import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", "nowhere.yaml", "--parallel", parallel])
    assert exit_.value.code == 2
    assert f"argument --parallel: must be in [1, 1024], got {parallel}" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,needle", [
    ("--batch", "0", "argument --batch: must be in [1, 4096], got 0"),
    ("--seq-len", "1000000000", "argument --seq-len: must be in [1, 1048576], got 1000000000"),
    ("--seed", "-1", "argument --seed: must be in [0, 9223372036854775807], got -1"),
    ("--rtol", "nan", "argument --rtol: must be in [0, 100], got nan"),
])
def test_convert_verify_counts(capsys, flag, value, needle):
    from sorl_megatron.bridge import convert_cli

    with pytest.raises(SystemExit) as exit_:
        convert_cli.main(["verify", "--hf", "x", f"{flag}={value}"])
    errors = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert exit_.value.code == 2 and len(errors) == 1 and needle in errors[0], errors


@pytest.mark.parametrize("size", ["garbage", "nanGB"])
def test_convert_shard_size(tmp_path, capsys, size):
    from sorl_megatron.bridge import convert_cli

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["megatron-to-hf", "--hf", str(model), "--out", str(tmp_path / "out"), "--max-shard-size", size]
    assert convert_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --max-shard-size must be a size like 4GB or 500MB"), err
