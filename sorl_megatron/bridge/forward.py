"""Forward passes through the model chunks with megatron's pipeline schedules."""

from __future__ import annotations

from typing import Optional

import torch

from ..common import comm
from .model import MegatronModel


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked. Passed explicitly: megatron's default mask is built
    with device='cuda'."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def model_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@torch.no_grad()
def forward_logits(model: MegatronModel, tokens: torch.Tensor, gather_vocab: bool = True) -> Optional[torch.Tensor]:
    """Logits [b, s, V] (or values [b, s, 1] for a value model) for `tokens` [b, s].

    Runs one micro-batch through the pipeline schedule (works for any PP/VPP). The result is
    broadcast from the last pipeline stage so every rank returns it. With `gather_vocab`
    the TP-sharded vocabulary is gathered; otherwise each TP rank keeps its shard.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = model_device()
    tokens = tokens.to(device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    mask = causal_attention_mask(s, device)
    was_training = [c.training for c in model.chunks]
    model.eval()

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        out = chunk(batch["tokens"], batch["position_ids"], batch["mask"])

        def collect(output, non_loss_data=False):
            if gather_vocab and not model.options.value_head and mpu.get_tensor_model_parallel_world_size() > 1:
                output = tensor_parallel.gather_from_tensor_model_parallel_region(output)
            return output.detach()

        return out, collect

    # One micro-batch normally; the interleaved (VPP) schedule needs at least PP micro-batches,
    # so there each sequence is its own micro-batch, padded with repeats to a multiple of PP.
    micro = [tokens]
    pp = mpu.get_pipeline_model_parallel_world_size()
    if len(model.chunks) > 1:
        micro = list(tokens.split(1))
        while len(micro) % pp:
            micro.append(micro[-1])
    batches = [
        {"tokens": m, "position_ids": position_ids[: m.shape[0]], "mask": mask} for m in micro
    ]
    n_chunks = len(model.chunks)
    iterators = [iter(batches) for _ in range(n_chunks)] if n_chunks > 1 else iter(batches)
    out = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators,
        model=model.chunks if n_chunks > 1 else model.chunks[0],
        num_microbatches=len(batches),
        seq_length=s,
        micro_batch_size=micro[0].shape[0],
        forward_only=True,
        collect_non_loss_data=True,
    )
    for c, mode in zip(model.chunks, was_training):
        c.train(mode)
    logits = torch.cat(list(out), dim=0)[:b] if out else None
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        logits = _broadcast_from_last_stage(logits)
    return logits


def _broadcast_from_last_stage(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    from megatron.core import parallel_state as mpu

    group = mpu.get_pipeline_model_parallel_group()
    last = mpu.get_pipeline_model_parallel_last_rank()
    shape, dtype = comm.broadcast_object((tuple(tensor.shape), tensor.dtype) if tensor is not None else None,
                                         src=last, group=group)
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=model_device())
    return comm.broadcast(tensor, src=last, group=group)
