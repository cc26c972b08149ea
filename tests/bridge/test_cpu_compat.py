"""Each CPU patch is still needed: reverted, its probe fails the documented way; applied, the
probe runs. (The logits tests fail too if any patch is removed.) A GPU cannot exist here, so
which patches apply on a CUDA build is checked by faking torch.cuda.is_available (and only that)."""

from __future__ import annotations

import pytest

from .harness import result

# Patches owned by other test suites (they revert them in their own workers).
PROBED_ELSEWHERE = {"optimizer_on_cpu": "tests/engine", "uneven_gather_on_gloo": "tests/engine",
                    "torch_adam_step_on_load": "tests/engine", "fresh_torch_adam_state_on_load": "tests/engine"}

EXPECTED_FAILURE = {
    "rng_on_cpu_generator": "Torch not compiled with CUDA enabled",
    "current_device_is_cpu": "Torch not compiled with CUDA enabled",
    "cuda_moves_are_no_ops": "Torch not compiled with CUDA enabled",
    "cuda_streams_are_no_ops": "torch.cuda.Stream requires CUDA support",
    "te_general_gemm_defined": "NameError: name 'te_general_gemm' is not defined",
    "all_to_all_splits_as_lists": "incompatible function arguments",
    "schedules_allocate_on_cpu": "Torch not compiled with CUDA enabled",
    "dist_ckpt_queue_forked": "EOFError",
    "mla_knows_te_is_missing": "isinstance() arg 2 must be a type",
}


def test_every_patch_has_a_probe():
    from sorl_megatron.bridge.cpu_compat import PATCHES

    assert set(PATCHES) == set(EXPECTED_FAILURE) | set(PROBED_ELSEWHERE)
    for patch in PATCHES.values():
        assert len(patch.why) > 40  # documented: what fails without it


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED_FAILURE))
def test_patch_is_needed_and_works(single_results, name):
    r = result(single_results, "compat_probes")
    assert name in r["probed"]
    without, with_ = r[f"{name}/without"], r[f"{name}/with"]
    assert without is not None and EXPECTED_FAILURE[name] in without, without
    assert with_ is None, with_


@pytest.mark.slow
def test_reverting_a_patch_keeps_the_patches_layered_over_it(single_results):
    r = result(single_results, "compat_probes")["layered"]
    outer, inner = "fresh_torch_adam_state_on_load", "optimizer_on_cpu"
    megatron = "megatron.core.optimizer.distrib_optimizer"
    assert r["before"] == r["after"] == [outer, inner, megatron], r
    assert r["inside"] == [outer, megatron], r


@pytest.fixture
def fresh_patches(monkeypatch):
    """Every patch unapplied, CUDA reported available (mocked: there is no GPU on these machines;
    only the device query is), and whatever the test applies reverted after it."""
    import torch

    from sorl_megatron.bridge import cpu_compat

    for patch in cpu_compat.PATCHES.values():
        monkeypatch.setattr(patch, "saved", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "_APPLIED", {})
    yield cpu_compat
    for name in reversed(cpu_compat.applied_patches()):
        cpu_compat.PATCHES[name].revert()


# What each patch mends on a CUDA build: TE and apex do not import here, as on the lent GPU image and
# any install whose TE build failed; there the TE-less bugs (the router's te_general_gemm NameError,
# seen on an H100) and torch Adam's checkpoint bugs (a resume with the distributed optimizer) occur too.
ON_A_GPU_WITHOUT_TE = {
    "te_general_gemm_defined": True, "mla_knows_te_is_missing": True,
    "torch_adam_step_on_load": True, "fresh_torch_adam_state_on_load": True,
}


@pytest.mark.parametrize("name", sorted(__import__("sorl_megatron.bridge.cpu_compat", fromlist=["PATCHES"]).PATCHES))
def test_each_patch_applies_on_a_gpu_where_its_condition_holds(fresh_patches, name):
    applied = fresh_patches.apply_cpu_compat()
    assert (name in applied) == ON_A_GPU_WITHOUT_TE.get(name, False), (name, applied)
    assert fresh_patches.applied_patches() == applied


def test_on_a_gpu_the_router_takes_torch_matmul_without_te(fresh_patches):
    fresh_patches.apply_cpu_compat()
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


def test_on_a_gpu_with_te_and_fused_adam_nothing_applies(fresh_patches, monkeypatch):
    from sorl_megatron.bridge import te_probe

    monkeypatch.setattr(te_probe, "te_import_error", lambda: None)
    monkeypatch.setattr(fresh_patches, "_without_fused_adam", lambda: False)
    assert fresh_patches.apply_cpu_compat() == []


def test_a_gpu_without_te_says_why_once(monkeypatch, caplog):
    import torch

    from sorl_megatron.bridge import te_probe

    te_probe._warn_once_on_gpu.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # mocked: the device query only
    with caplog.at_level("WARNING", logger="sorl_megatron.bridge.te_probe"):
        assert not te_probe.transformer_engine_available() and not te_probe.transformer_engine_available()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "transformer_engine is not installed" in said[0], said
    te_probe._warn_once_on_gpu.cache_clear()


_IMPORT_MEGATRON = """
import warnings, sys
warnings.simplefilter("always")
if sys.argv[1] == "quiet":
    from sorl_megatron.bridge.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_cpu_only_te_apex_warnings_are_quieted(mode):
    # A fresh interpreter: megatron's "not installed" warnings fire once, at its first import.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _IMPORT_MEGATRON, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    noisy = "Apex is not installed" in out.stderr
    assert noisy == (mode == "plain"), out.stderr[-2000:]


_WARN_ALL = """
import sys, warnings
warnings.simplefilter("always")
if sys.argv[1] == "quiet":
    from sorl_megatron.bridge.cpu_compat import apply_cpu_compat
    apply_cpu_compat()
warnings.warn("When using sequence parallelism it is recommended to set the environment variable "
              "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
warnings.warn("When using async grad allreduce it is recommended to set the environment variable "
              "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
warnings.warn("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.")
warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
              FutureWarning)
warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
warnings.warn("a real warning about CUDA_DEVICE_MAX_CONNECTIONS")
warnings.warn("`load_state_dict` is deprecated and will be removed in future versions.", UserWarning)
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_cpu_irrelevant_warnings_are_quieted_and_nothing_else(mode):
    """The CUDA-only and checkpoint-loading notices a CPU run printed (issue 21) are quieted by
    the CPU patches; other warnings, even with similar words or another category, are not."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WARN_ALL, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shown = [line for line in out.stderr.splitlines() if line.startswith("<string>:")]  # not the import's own
    assert len(shown) == (2 if mode == "quiet" else 7), out.stderr
    if mode == "quiet":
        assert "a real warning" in shown[0] and shown[1].endswith("UserWarning: `load_state_dict` is deprecated and "
                                                                  "will be removed in future versions.")
