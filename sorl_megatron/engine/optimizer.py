"""A trained engine's optimizer: megatron's Adam over the model chunks, its LR schedule, and one
step of them with a clip-bias ``factor`` placed on the gradient, the clipped gradient or the LR.

The engine holds one (``EngineBase.stepper``; None for a frozen engine) and counts the steps;
checkpoints save and restore the optimizer's and the schedule's state in place.
"""

from __future__ import annotations

import math

import torch

from ..bridge.model import MegatronModel
from .config import OptimConfig, check


def factor_scales(factor: float, apply_to: str, grad_norm: float, clip: float) -> dict[str, float]:
    """What a clip-bias ``factor`` placed at ``apply_to`` leaves on the step: ``grad_scale`` on
    the gradient Adam receives (with ``grad``, global clipping to ``clip`` takes back whatever
    pushed the norm over it; ``grad_norm`` is the norm clipping saw) and ``lr_scale`` on the
    step size. Under Adam only ``lr_scale`` scales the parameter update itself."""

    def clip_coef(norm: float) -> float:  # megatron's clip_grad_by_total_norm_fp32
        return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0

    grad_scale = 1.0
    if apply_to == "clipped_grad":
        grad_scale = factor
    elif apply_to == "grad" and factor != 1.0 and math.isfinite(grad_norm) and grad_norm > 0:
        grad_scale = factor * clip_coef(grad_norm) / clip_coef(grad_norm / factor)
    return {"clip_bias/grad_scale": grad_scale, "clip_bias/lr_scale": factor if apply_to == "lr" else 1.0}


class OptimizerStep:
    """Megatron's optimizer and LR scheduler over ``model``'s chunks (``optim``: Adam, schedule and
    clipping, read at each step); the model's config takes the optimizer's gradient finalization
    and loss scaling."""

    def __init__(self, optim: OptimConfig, model: MegatronModel):
        import megatron.core.optimizer as mopt
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.optim = o = optim
        self.model = model
        dtype = model.dtype
        oc = mopt.OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        self.optimizer = mopt.get_megatron_optimizer(oc, model.chunks)
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.grad_scale_func = self.optimizer.scale_loss
        check(
            o.lr_schedule == "constant" or o.decay_steps is not None,
            f"optim.decay_steps is required for lr_schedule={o.lr_schedule!r}",
        )
        decay_steps = o.decay_steps if o.decay_steps is not None else o.warmup_steps + 1
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    def zero_grads(self) -> None:
        for c in self.model.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, factor: float = 1.0, apply_to: str = "lr") -> dict[str, float]:
        """Advance the LR schedule, clip the accumulated (DP-reduced) gradient and step, with
        ``factor`` applied to the gradient before clipping (``grad``), after it (``clipped_grad``)
        or to this step's learning rate (``lr``).

        Megatron's ``optimizer.step()`` is unrolled (prepare, norm/clip, step) so the factor can
        sit after clipping and the pre-clip norm is known for every loss.
        """
        opt = self.optimizer
        if factor != 1.0 and apply_to == "grad":
            for c in self.model.chunks:
                c.scale_gradients(factor)
        self.scheduler.step(1)
        groups = opt.param_groups
        saved = [g["lr"] for g in groups]
        lr_scale = factor if apply_to == "lr" else 1.0
        for g in groups:
            g["lr"] = g["lr"] * lr_scale
        try:
            if opt.prepare_grads():  # inf/nan in the gradient (loss scaling): skip the step
                ok, grad_norm = False, float("nan")
            else:
                grad_norm = float(opt.get_grad_norm())
                self._clip_and_scale(grad_norm, factor if apply_to == "clipped_grad" else 1.0)
                ok = bool(opt.step_with_ready_grads())
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        return {
            "grad_norm": grad_norm,  # before clipping (and after a `grad` factor)
            "lr": float(saved[0]) * lr_scale if saved else 0.0,
            "update_ok": float(ok),
        }

    def _clip_and_scale(self, grad_norm: float, factor: float) -> None:
        """Megatron's global clipping of the main gradients to ``clip_grad`` (as its
        ``step()`` does it, for a single or a chained dense + expert optimizer), then
        ``factor`` on the clipped gradients."""
        from megatron.core.optimizer import clip_grads

        clip = self.optim.clip_grad
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
            if not params:
                continue
            decoupled = bool(getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
            if clip > 0:
                clip_grads.clip_grad_by_total_norm_fp32(
                    params, max_norm=clip, total_norm=grad_norm, use_decoupled_grad=decoupled
                )
            if factor != 1.0:
                for p in params:
                    grad = p.decoupled_grad if decoupled else p.grad
                    if grad is not None:
                        grad.mul_(factor)
