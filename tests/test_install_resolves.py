"""What users install resolves: the project with its ``gpu`` extra (the trainer's environment on
a GPU machine) and ``requirements-sglang.txt`` (SGLang's own environment, ``make sglang-env``),
each through pip's own resolver (``pip install --dry-run --ignore-installed --report -``) against
the package index pip is configured with. Nothing is installed.

A quick probe of that index (``pip index versions``) comes first; the tests skip, saying so,
only when it cannot be reached. Resolving downloads metadata and builds some of it: minutes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests import sglang_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = sglang_wheel.ROOT


def pip(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def index_reachable():
    try:
        out = pip("index", "versions", "sglang", "--timeout", "10", "--retries", "0", timeout_s=60)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index pip is configured with did not answer within 60 s")
    if out.returncode != 0:
        pytest.skip(f"the package index pip is configured with cannot be reached: {out.stderr.strip()[-300:]}")


def resolve(*requirements: str) -> dict[str, str]:
    """{name: version} of everything pip would install for ``requirements``, or the test fails
    with pip's reason."""
    out = pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", *requirements,
              timeout_s=1700)
    if out.returncode != 0:
        tail = out.stderr.strip()[-3000:]
        if "metadata-generation-failed" in tail and "URLError" in tail:
            # a stub source package that downloads its wheel from its vendor's own index (SGLang's
            # cuda-tile comes from NVIDIA's) when that index cannot be reached from here
            package = re.findall(r"╰─> (\S+)", tail)
            pytest.skip(f"the metadata of {package[-1] if package else 'a dependency'} must be downloaded from its "
                        "vendor's package index, which this machine cannot reach (URLError)")
        pytest.fail(f"pip cannot resolve {requirements}:\n{tail}")
    report = json.loads(out.stdout)
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}


def release(version: str) -> str:
    return version.split("+", 1)[0]  # 2.13.0+cu130 / +cpu: the same release


def test_the_gpu_extra_resolves(index_reachable):
    got = resolve(".[gpu]")
    assert release(got["torch"]) == sglang_wheel.trainer_torch()
    assert "transformer-engine" in got and "sglang" not in got


def test_the_sglang_environment_resolves_on_the_trainers_torch(index_reachable):
    got = resolve("-r", "requirements-sglang.txt")
    pins = sglang_wheel.pins()
    assert got["sglang"] == pins["sglang"]
    assert release(got["torch"]) == pins["torch"] == sglang_wheel.trainer_torch()


def test_the_gpu_extra_pins_transformer_engine_where_megatron_core_accepts_it():
    """megatron-core 0.16.1 declares TE >= 2.9, < 2.12 (its dev extra); a TE outside that range
    installs and then fails at import or at its first fused kernel. The range is read from the
    installed megatron-core's metadata, not copied."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    mcore = next(Requirement(r) for r in md.requires("megatron-core") or [] if r.startswith("transformer-engine"))
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    ours = next(Requirement(r) for r in extra if r.startswith("transformer-engine"))
    probes = [Version(v) for v in ("2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.11.9", "2.12.0", "2.20.0")]
    allowed = [v for v in probes if v in ours.specifier]
    assert allowed and all(v in mcore.specifier for v in allowed), (str(ours.specifier), str(mcore.specifier))
