"""Each CPU patch is still needed: reverted, its probe fails the documented way; applied, the
probe runs. (The logits tests fail too if any patch is removed.) A GPU cannot exist here, so
the "CUDA available -> nothing applied" branch is checked by faking torch.cuda.is_available."""

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


def test_only_the_te_less_patches_apply_when_cuda_is_available(monkeypatch):
    # Mocked: there is no GPU on these machines. TE does not import here, as on the GPU machine
    # where the router's te_general_gemm NameError was seen: those patches apply there too.
    import torch

    from sorl_megatron.bridge import cpu_compat

    for patch in cpu_compat.PATCHES.values():
        monkeypatch.setattr(patch, "saved", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "_APPLIED", {})
    try:
        applied = cpu_compat.apply_cpu_compat()
        assert applied == ["te_general_gemm_defined", "mla_knows_te_is_missing"]
        assert cpu_compat.applied_patches() == applied
        from megatron.core.transformer.moe import moe_utils

        assert moe_utils.te_general_gemm is None  # the router takes torch's matmul
    finally:
        for name in reversed(cpu_compat.applied_patches()):
            cpu_compat.PATCHES[name].revert()


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
