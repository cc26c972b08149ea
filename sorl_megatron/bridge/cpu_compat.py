"""Make megatron-core 0.16.1 and mbridge 0.15.1 run on a CPU-only torch with gloo.

Applied by `apply_cpu_compat()`. Each patch names the condition it mends (`when`), and applies
wherever that condition holds, on a CPU and a GPU alike:
- `ON_CPU`: CUDA is unavailable (device and stream stand-ins, gloo's rules);
- `WITHOUT_TE`: TransformerEngine does not import (megatron-core 0.16.1 bugs of a TE-less install,
  seen on an H100: the MoE router's `te_general_gemm` NameError);
- `WITHOUT_FUSED_ADAM`: neither TE's nor apex's FusedAdam imports, so megatron's distributed
  optimizer runs torch's Adam (its own flag, `distrib_optimizer.HAVE_APEX_OR_TE`), whose
  per-parameter step its checkpoints do not save.
On a CPU every patch applies. Every patch below is a named `CpuPatch` whose
docstring says what fails without it; tests/bridge/test_cpu_compat.py reverts each one in turn and checks that the
documented failure comes back (so a patch that stops being needed is noticed), and the
logits tests fail if any is removed.

What is NOT patched, and is handled by the caller instead:
- `attention_mask=None` makes megatron build a causal mask with device="cuda";
  `forward.causal_attention_mask()` passes an explicit one.
- TransformerEngine / apex fused kernels: the local layer spec (local_spec.py) and config
  flags (no fusions, no grouped-gemm) avoid them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .cpu_compat_collectives import uneven_gather_targets
from .cpu_compat_optimizer import fresh_torch_adam_targets, optimizer_targets, torch_adam_step_targets
from .cpu_modes import CudaDeviceToCpu

_APPLIED: dict[str, "CpuPatch"] = {}

ON_CPU, WITHOUT_TE, WITHOUT_FUSED_ADAM = "on_cpu", "without_te", "without_fused_adam"


def _without_fused_adam() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def conditions_held(on_cpu: bool) -> set[str]:
    """The conditions true in this process (on a CPU, all of them: nothing there is fused)."""
    from .te_probe import te_import_error

    if on_cpu:
        return {ON_CPU, WITHOUT_TE, WITHOUT_FUSED_ADAM}
    held = {WITHOUT_TE} if te_import_error() is not None else set()
    return held | ({WITHOUT_FUSED_ADAM} if _without_fused_adam() else set())


@dataclass
class CpuPatch:
    """One monkeypatch: a list of (owner, attribute, replacement) triples."""

    name: str
    why: str
    targets: Callable[[], list[tuple[Any, str, Any]]]
    when: str = ON_CPU  # the condition it mends: ON_CPU, WITHOUT_TE or WITHOUT_FUSED_ADAM
    saved: list[tuple[Any, str, Any, bool]] = field(default_factory=list)

    def apply(self) -> None:
        if self.saved:
            return
        for owner, attr, new in self.targets():
            had = attr in vars(owner) if isinstance(owner, type) else hasattr(owner, attr)
            self.saved.append((owner, attr, getattr(owner, attr, None), had))
            setattr(owner, attr, new)

    def revert(self) -> None:
        for owner, attr, old, had in reversed(self.saved):
            if had:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
        self.saved.clear()


# --------------------------------------------------------------------------------------
# Stand-ins


class _NoOpStream:
    """A CUDA stream/event stand-in: on CPU every op is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> "_NoOpStream":
        return _NoOpStream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def __enter__(self) -> "_NoOpStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _on_cpu_device(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CudaDeviceToCpu():
            return fn(*args, **kwargs)

    wrapper.__wrapped_for_cpu__ = fn  # type: ignore[attr-defined]
    return wrapper


def _splits_as_lists(all_to_all_single: Callable) -> Callable:
    @functools.wraps(all_to_all_single)
    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        def as_list(sizes):
            return None if sizes is None else [int(s) for s in sizes]

        return all_to_all_single(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs
        )

    return wrapper


# --------------------------------------------------------------------------------------
# The patches


def _rng_targets() -> list[tuple[Any, str, Any]]:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    return [
        (mrandom, "_get_cuda_rng_state", get_state),
        (mrandom, "_set_cuda_rng_state", set_state),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        # Not manual_seed_all: patching it recursed inside torch.manual_seed.
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
    ]


def _current_device_targets() -> list[tuple[Any, str, Any]]:
    return [(torch.cuda, "current_device", lambda: "cpu")]


def _module_cuda_targets() -> list[tuple[Any, str, Any]]:
    def module_cuda(self, device: Any = None):
        return self

    def tensor_cuda(self, device: Any = None, non_blocking: bool = False, **kwargs: Any):
        return self

    return [(torch.nn.Module, "cuda", module_cuda), (torch.Tensor, "cuda", tensor_cuda)]


def _stream_targets() -> list[tuple[Any, str, Any]]:
    return [
        (torch.cuda, "Stream", _NoOpStream),
        (torch.cuda, "Event", _NoOpStream),
        (torch.cuda, "current_stream", lambda device=None: _NoOpStream()),
        (torch.cuda, "stream", _stream_context),
        (torch.cuda, "synchronize", _no_op),
    ]


def _te_gemm_targets() -> list[tuple[Any, str, Any]]:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    return [(moe_utils, "te_general_gemm", None)]


def _mla_te_targets() -> list[tuple[Any, str, Any]]:
    from megatron.core.transformer import multi_latent_attention as mla

    if not mla.HAVE_TE or isinstance(mla.TELinear, type):
        return []  # TE really imports (or the module already knows it does not)
    return [(mla, "HAVE_TE", False)]


def _all_to_all_targets() -> list[tuple[Any, str, Any]]:
    return [(torch.distributed, "all_to_all_single", _splits_as_lists(torch.distributed.all_to_all_single))]


def _schedule_targets() -> list[tuple[Any, str, Any]]:
    from megatron.core.pipeline_parallel import schedules

    names = (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    )
    return [(schedules, n, _on_cpu_device(getattr(schedules, n))) for n in names]


def _fork_results_queue():
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from ..common.procutil import die_with_parent

    if filesystem_async._results_queue is None:
        # The manager process must not outlive a trainer killed with SIGKILL (no cleanup runs).
        manager = SyncManager(ctx=mp.get_context("fork"))
        manager.start(initializer=die_with_parent)
        filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue


def _dist_ckpt_queue_targets() -> list[tuple[Any, str, Any]]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return [(filesystem_async, "_get_write_results_queue", _fork_results_queue)]


PATCHES: dict[str, CpuPatch] = {
    p.name: p
    for p in (
        CpuPatch(
            "rng_on_cpu_generator",
            "model_parallel_cuda_manual_seed and the RNG tracker's fork() (used by every "
            "attention and weight init) read/write CUDA generator state: 'AssertionError: "
            "Torch not compiled with CUDA enabled'. Route them to the CPU generator.",
            _rng_targets,
        ),
        CpuPatch(
            "current_device_is_cpu",
            "torch.cuda.current_device() is used as a device for buffers (GlobalMemoryBuffer, "
            "router weights, p2p shape tensors): same CUDA assertion. Answer 'cpu'.",
            _current_device_targets,
        ),
        CpuPatch(
            "cuda_moves_are_no_ops",
            "mbridge's get_model calls module.cuda() and megatron's tied-embedding setup at "
            "PP>1 calls weight.data.cuda(): 'Torch not compiled with CUDA enabled'. On a CPU "
            "host .cuda() returns the object unchanged.",
            _module_cuda_targets,
        ),
        CpuPatch(
            "cuda_streams_are_no_ops",
            "The MoE alltoall dispatcher creates torch.cuda.Stream() (cuda_dtoh_stream) and "
            "p2p calls torch.cuda.synchronize(): 'torch.cuda.Stream requires CUDA support'. "
            "CPU ops are ordered, so stand-ins that do nothing are exact.",
            _stream_targets,
        ),
        CpuPatch(
            "te_general_gemm_defined",
            "megatron-core 0.16.1 moe_utils references te_general_gemm in the router gating "
            "but only defines it when TransformerEngine imports: NameError. Define it as None "
            "(megatron then uses torch matmul). On a GPU without TE too.",
            _te_gemm_targets,
            when=WITHOUT_TE,
        ),
        CpuPatch(
            "mla_knows_te_is_missing",
            "megatron-core 0.16.1's multi_latent_attention sets HAVE_TE=True once "
            "megatron.core.extensions.transformer_engine imports, and that module imports "
            "without TE (it builds its classes on a MagicMock), so MLASelfAttention.__init__ "
            "evaluates isinstance(self.linear_proj, TELinear) with TELinear a MagicMock: "
            "'TypeError: isinstance() arg 2 must be a type' (multi_latent_attention.py:185). "
            "Tell that module TE is absent when its TELinear is not a class. On a GPU without TE too.",
            _mla_te_targets,
            when=WITHOUT_TE,
        ),
        CpuPatch(
            "all_to_all_splits_as_lists",
            "The EP alltoall dispatcher passes split sizes as tensors/arrays; gloo's "
            "all_to_all_single only accepts lists: 'all_to_all_single(): incompatible function "
            "arguments'. Convert them to lists of ints.",
            _all_to_all_targets,
        ),
        CpuPatch(
            "schedules_allocate_on_cpu",
            "Every pipeline schedule allocates torch.zeros(..., device='cuda') for the token "
            "count: CUDA assertion. Run the schedules under a torch function mode that maps "
            "device='cuda' to the CPU.",
            _schedule_targets,
        ),
        CpuPatch(
            "optimizer_on_cpu",
            "megatron's optimizers allocate device='cuda' tensors (FP32Optimizer._scale, grad-norm "
            "buffers), clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor' "
            "and the distributed optimizer rejects parameters whose type() is not a CUDA type. Run "
            "the optimizer factory, the clip_grads helpers and the optimizer methods under a torch "
            "function mode that maps device='cuda' to the CPU and reports CUDA type names "
            "(cpu_compat_optimizer.py); nothing outside optimizer code sees it.",
            optimizer_targets,
        ),
        CpuPatch(
            "uneven_gather_on_gloo",
            "With ETP > 1 and EP > 1 (TP2 x EP2) the alltoall dispatcher all-gathers a different "
            "number of tokens from each expert-TP rank; gloo's all_gather takes equal sizes only: "
            "'ProcessGroupGloo::allgather: invalid tensor size'. Pad to the largest split, gather "
            "evenly, drop the padding (cpu_compat_collectives.py); even gathers stay megatron's.",
            uneven_gather_targets,
        ),
        CpuPatch(
            "torch_adam_step_on_load",
            "Without apex / TE's fused Adam, the distributed optimizer runs torch's Adam, whose state "
            "holds a per-parameter 'step' that megatron 0.16's fully reshardable checkpoint does not "
            "save (it keeps one step per param group): loading one fails with KeyError: 'step'. Copy "
            "the saved tensors and set each parameter's step from its group's (cpu_compat_optimizer.py).",
            torch_adam_step_targets,
            when=WITHOUT_FUSED_ADAM,
        ),
        CpuPatch(
            "fresh_torch_adam_state_on_load",
            "Loading a distributed-optimizer checkpoint into an optimizer that has not stepped: "
            "megatron's sharded_state_dict(is_loading=True) first calls state_dict(), which without "
            "apex / TE reads torch Adam's per-parameter step, absent before the first step: "
            "AssertionError (assert len(steps) == 1, distrib_optimizer.py). Give it a state first with "
            "megatron's own dummy step at learning rate and weight decay 0 (cpu_compat_optimizer.py).",
            fresh_torch_adam_targets,
            when=WITHOUT_FUSED_ADAM,
        ),
        CpuPatch(
            "dist_ckpt_queue_forked",
            "dist_checkpointing's async writer gets its results queue from a *spawned* "
            "multiprocessing Manager, which re-imports __main__: a script without an "
            "`if __name__ == '__main__'` guard dies with EOFError, and a guarded one pays a "
            "second import of torch+megatron (~5-10 s on these CPUs) per process. Start the "
            "Manager with fork instead (it only serves a queue; nothing in it touches torch).",
            _dist_ckpt_queue_targets,
        ),
    )
}


def cuda_available() -> bool:
    return torch.cuda.is_available()


class _DropCpuRngWarning(logging.Filter):
    # With the RNG tracker on the CPU generator, megatron's "CPU RNG state changed within GPU
    # RNG context" check fires on every fork: it compares the generator with itself.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# Warnings that say nothing on a CPU machine (on GPU they stay): TransformerEngine and apex
# cannot exist there; CUDA_DEVICE_MAX_CONNECTIONS and CUDA-graph scopes are CUDA settings; and
# loading a checkpoint prints deprecation notices of megatron's and torch's own internals
# (ShardedTensor, DCP's load_state_dict), nothing a user of this project can act on.
_NOT_ON_CPU_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning),
    (r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
     r"variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning),
    (r"`load_state_dict` is deprecated and will be removed in future versions", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
)


def apply_cpu_compat(force: bool = False) -> list[str]:
    """Apply every patch whose condition holds here (all of them if CUDA is unavailable, or
    `force`); idempotent. Returns the applied names."""
    on_cpu = force or not cuda_available()
    if on_cpu and not any(p.when == ON_CPU for p in _APPLIED.values()):  # the CPU patches' first time
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropCpuRngWarning())
        for message, category in _NOT_ON_CPU_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
    held = conditions_held(on_cpu)
    for name, patch in PATCHES.items():
        if name not in _APPLIED and patch.when in held:
            patch.apply()
            _APPLIED[name] = patch
    return list(_APPLIED)


def applied_patches() -> list[str]:
    return list(_APPLIED)


@contextlib.contextmanager
def without_patch(name: str) -> Iterator[None]:
    """Temporarily undo one patch (tests use this to show the patch is still needed).

    Patches applied after it may wrap what it replaced (several wrap optimizer methods), so
    they come off first and go back on top of whatever is there without it."""
    if name not in _APPLIED:
        yield
        return
    applied = list(_APPLIED)
    later = [PATCHES[n] for n in applied[applied.index(name) + 1:]]
    for patch in reversed(later):
        patch.revert()
    PATCHES[name].revert()
    for patch in later:
        patch.apply()
    try:
        yield
    finally:
        for patch in reversed(later):
            patch.revert()
        PATCHES[name].apply()
        for patch in later:
            patch.apply()
