"""CPU stand-ins for megatron-core's optimizer code (the `optimizer_on_cpu`, `torch_adam_step_on_load`
and `fresh_torch_adam_state_on_load` CpuPatches).

megatron-core 0.16.1's optimizer stack assumes CUDA in three ways:
- it allocates with ``device='cuda'`` (``FP32Optimizer._scale``, the grad-norm and
  zero-count buffers in ``clip_grads.py``, the distributed optimizer's gather buffers);
- ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``;
- the distributed optimizer (and the fp16 optimizer) accept parameters only when
  ``param.type()`` is one of ``torch.cuda.{Float,Half,BFloat16}Tensor``.

Instead of changing ``torch.Tensor.type`` for the whole process, the entry points are run
under a torch function mode that (a) maps ``device='cuda'`` to the CPU and (b) answers a
no-argument ``Tensor.type()`` of a CPU tensor with the CUDA type name. The mode is active
only while megatron's optimizer code runs, so nothing else in the process sees it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .cpu_modes import CudaTypeNamesOnCpu


def on_cpu_optimizer(fn: Callable) -> Callable:
    """Run `fn` under :class:`CudaTypeNamesOnCpu`."""
    if getattr(fn, "__sorl_cpu_optimizer__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with CudaTypeNamesOnCpu():
            return fn(*args, **kwargs)

    wrapper.__sorl_cpu_optimizer__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped_for_cpu__ = fn  # type: ignore[attr-defined]
    return wrapper


_METHODS = (
    "step",
    "prepare_grads",
    "step_with_ready_grads",
    "get_grad_norm",
    "clip_grad_norm",
    "count_zeros",
    "load_state_dict",
    "sharded_state_dict",
    "state_dict",
    "zero_grad",
)


def optimizer_targets() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) triples: the optimizer factory, the clip_grads helpers
    (in every module that imported them by name), and the public methods of every optimizer
    class, each wrapped with :func:`on_cpu_optimizer`."""
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    targets: list[tuple[Any, str, Any]] = [
        (mopt, "get_megatron_optimizer", on_cpu_optimizer(mopt.get_megatron_optimizer)),
    ]
    for module in (clip_grads, optimizer, distrib_optimizer):
        for name in ("clip_grad_by_total_norm_fp32", "get_grad_norm_fp32", "count_zeros_fp32"):
            if hasattr(module, name):
                targets.append((module, name, on_cpu_optimizer(getattr(module, name))))
    classes = [
        optimizer.MegatronOptimizer,
        optimizer.MixedPrecisionOptimizer,
        optimizer.FP32Optimizer,
        optimizer.ChainedOptimizer,
        distrib_optimizer.DistributedOptimizer,
    ]
    for cls in classes:
        for name in _METHODS:
            if name in vars(cls):  # wrap each class's own definition only
                targets.append((cls, name, on_cpu_optimizer(vars(cls)[name])))
    return targets


def _set_states_with_torch_adam_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        group = self.optimizer.param_groups[group_index]
        state = self.optimizer.state.get(group["params"][group_order], {})
        if "step" not in tensors and "step" in state:
            # torch Adam's per-parameter step is not in the saved tensors; the common state saved
            # it once per param group (DistributedOptimizer.state_dict without apex / TE), and
            # load_state_dict has put it back into the group by now.
            step = state.pop("step")
            try:
                original(self, model_param, tensors)
            finally:
                # a tensor of its own: the load may have left one step tensor shared by every
                # parameter, which Adam would then advance once per parameter
                value = step if group.get("step") is None else float(group["step"])
                state["step"] = torch.as_tensor(value, dtype=step.dtype, device=step.device).clone()
            return None
        return original(self, model_param, tensors)

    set_states.__wrapped_for_cpu__ = original  # type: ignore[attr-defined]
    return set_states


def torch_adam_step_targets() -> list[tuple[Any, str, Any]]:
    """``DistributedOptimizer._set_main_param_and_optimizer_states``, which a fully reshardable
    load calls per parameter with the saved ``param`` / ``exp_avg`` / ``exp_avg_sq``."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    name = "_set_main_param_and_optimizer_states"
    return [(cls, name, _set_states_with_torch_adam_step(vars(cls)[name]))]


def _with_dummy_state_before_load(original: Callable) -> Callable:
    # updated=(): not the attributes of optimizer_on_cpu's wrapper below it (its "already wrapped" mark)
    @functools.wraps(original, updated=())
    def sharded_state_dict(self, *args, **kwargs):
        from megatron.core.optimizer import distrib_optimizer

        is_loading = kwargs["is_loading"] if "is_loading" in kwargs else len(args) > 1 and bool(args[1])
        fresh = self.optimizer is not None and not self.optimizer.state
        if is_loading and fresh and not distrib_optimizer.HAVE_APEX_OR_TE:
            # megatron's own dummy step (zero gradients), at learning rate and weight decay 0 so
            # that nothing moves; the load overwrites every value it creates.
            saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"], g["weight_decay"] = 0.0, 0.0
            try:
                self._init_optimizer_states_with_dummy_values()
            finally:
                for g, (lr, wd) in zip(self.optimizer.param_groups, saved):
                    g["lr"], g["weight_decay"] = lr, wd
        return original(self, *args, **kwargs)

    sharded_state_dict.__wrapped_for_cpu__ = original  # type: ignore[attr-defined]
    sharded_state_dict.__sorl_cpu_patch__ = "fresh_torch_adam_state_on_load"  # type: ignore[attr-defined]
    return sharded_state_dict


def fresh_torch_adam_targets() -> list[tuple[Any, str, Any]]:
    """``DistributedOptimizer.sharded_state_dict``, whose loading form first calls
    ``state_dict()``, which reads torch Adam's per-parameter step."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    return [(cls, "sharded_state_dict", _with_dummy_state_before_load(vars(cls)["sharded_state_dict"]))]
