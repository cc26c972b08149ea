"""One probe per CPU patch: with the patch reverted it must fail the way cpu_compat.py says
(so a patch that is no longer needed gets noticed), and with it applied it must run.

Runs inside worker.py (megatron imported, process group up). The GPU side cannot be probed
here: there is no GPU on these machines; on one, apply_cpu_compat() applies only the patches
whose condition holds there (no TE, no fused Adam: `CpuPatch.when`).
"""

from __future__ import annotations

import torch

from sorl_megatron.bridge.cpu_compat import PATCHES, apply_cpu_compat, without_patch


def _rng():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)


def _current_device():
    from megatron.core.utils import GlobalMemoryBuffer

    GlobalMemoryBuffer().get_tensor((4,), torch.float32, "probe")


def _module_cuda():
    torch.nn.Linear(2, 2).cuda()


def _streams():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    torch.cuda.Stream()


def _te_gemm():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    x = torch.randn(3, 4)
    w = torch.randn(2, 4)
    out = router_gating_linear(x, w, None, torch.float32)
    assert torch.allclose(out, x @ w.T, atol=1e-6)


def _all_to_all():
    # The dispatcher's split sizes on CPU are int64 tensors (only CUDA ones become numpy).
    world = torch.distributed.get_world_size()
    x = torch.arange(4.0 * world)
    out = torch.empty_like(x)
    splits = torch.full((world,), 4, dtype=torch.int64)
    torch.distributed.all_to_all_single(out, x, output_split_sizes=splits, input_split_sizes=splits)
    assert out.shape == x.shape


def _schedules():
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
            self.w = torch.nn.Parameter(torch.ones(2))
            self.model_type = ModelType.encoder_or_decoder

        def set_input_tensor(self, t):
            pass

    def step(it, model):
        out = model.w.sum()
        return out, lambda o, non_loss_data=False: o.detach()

    schedules.forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=iter([None]), model=[Tiny()], num_microbatches=1,
        seq_length=1, micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
    )


def _dist_ckpt_queue():
    # Pretend __main__ is a script without a main guard (it exits when re-imported): the
    # spawned Manager then dies during start-up. The forked one never re-imports it.
    import sys
    import tempfile
    import types

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    script.write("raise SystemExit('re-imported __main__')\n")
    script.close()
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = script.name
    real_main, saved_queue = sys.modules["__main__"], filesystem_async._results_queue
    sys.modules["__main__"], filesystem_async._results_queue = fake_main, None
    try:
        filesystem_async._get_write_results_queue().put(1)
    finally:
        sys.modules["__main__"] = real_main
        filesystem_async._results_queue = saved_queue


def _mla():
    from megatron.core import parallel_state
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from sorl_megatron.bridge import ParallelLayout, init_parallel
    from sorl_megatron.bridge.local_spec import _mla_attention_spec

    if not parallel_state.model_parallel_is_initialized():
        init_parallel(ParallelLayout())
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4,
        qk_pos_emb_head_dim=4, v_head_dim=4, rope_type="rope", normalization="RMSNorm", use_cpu_initialization=True,
        add_bias_linear=False,
    )
    build_module(_mla_attention_spec("sdpa"), config=cfg, layer_number=1)


PROBES = {
    "rng_on_cpu_generator": _rng,
    "current_device_is_cpu": _current_device,
    "cuda_moves_are_no_ops": _module_cuda,
    "cuda_streams_are_no_ops": _streams,
    "te_general_gemm_defined": _te_gemm,
    "all_to_all_splits_as_lists": _all_to_all,
    "schedules_allocate_on_cpu": _schedules,
    "dist_ckpt_queue_forked": _dist_ckpt_queue,
    "mla_knows_te_is_missing": _mla,
}


def _run(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _layers(fn) -> list[str]:
    """What wraps DistributedOptimizer.sharded_state_dict, outermost first."""
    out = []
    while fn is not None:
        if getattr(fn, "__sorl_cpu_optimizer__", False):
            out.append("optimizer_on_cpu")
        elif getattr(fn, "__sorl_cpu_patch__", None):
            out.append(fn.__sorl_cpu_patch__)
        else:
            out.append(fn.__module__)
        fn = getattr(fn, "__wrapped_for_cpu__", None)
    return out


def _layered() -> dict:
    """Reverting optimizer_on_cpu, which fresh_torch_adam_state_on_load wraps over, keeps the
    latter applied, and both come back in their order."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def layers():
        return _layers(vars(DistributedOptimizer)["sharded_state_dict"])

    before = layers()
    with without_patch("optimizer_on_cpu"):
        inside = layers()
    return {"before": before, "inside": inside, "after": layers()}


def run_probes() -> dict:
    apply_cpu_compat()
    out = {"patches": sorted(PATCHES), "probed": sorted(PROBES)}
    for name, fn in PROBES.items():
        with without_patch(name):
            out[f"{name}/without"] = _run(fn)
        out[f"{name}/with"] = _run(fn)
    out["layered"] = _layered()
    return out
