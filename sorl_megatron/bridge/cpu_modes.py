"""Torch function modes that run CUDA-assuming megatron code on the CPU (see cpu_compat.py).

They sit below both ``cpu_compat`` (the patch registry) and ``cpu_compat_optimizer`` (the
optimizer stand-ins), which each wrap megatron functions in them.
"""

from __future__ import annotations

import torch


class CudaDeviceToCpu(torch.overrides.TorchFunctionMode):
    """Rewrite `device="cuda"` keyword arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


class CudaTypeNamesOnCpu(CudaDeviceToCpu):
    """``device='cuda'`` -> CPU, and ``cpu_tensor.type()`` -> ``'torch.cuda.FloatTensor'`` etc."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return super().__torch_function__(func, types, args, kwargs)
