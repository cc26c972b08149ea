"""How an engine's passes are cut: this data-parallel rank's micro-batches of a forward-only
pass or of one mini-batch of an update, and what the cuts cost.

``packing.py`` makes the plans (every rank the same, from the rows' lengths alone); the
:class:`MicroBatcher` an engine holds (``EngineBase.batcher``) owns its batching settings, turns
a plan into this rank's micro-batch dicts, and counts the tokens and micro-batches of every
pass since the last :meth:`~MicroBatcher.begin_pass` for the ``batching/*`` metrics.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..bridge.layout import ParallelLayout
from .config import BatchingConfig
from .offload import device
from .packing import DUMMY, MicroBatchPlan, PackedRow, make_plan, rows_by_rank, update_rows
from .rl_batch import RLBatch


def rank_info() -> dict[str, int]:
    from megatron.core import parallel_state as mpu

    return {
        "dp": mpu.get_data_parallel_world_size(),
        "dp_rank": mpu.get_data_parallel_rank(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "last_stage": int(mpu.is_pipeline_last_stage(ignore_virtual=True)),
    }


class MicroBatcher:
    """An engine's batching settings, the micro-batches they cut on this rank and the counts of
    the passes cut since :meth:`begin_pass`.

    ``layout``: the model's (TP under sequence parallelism rounds the sequence length);
    ``interleaved``: the model has virtual pipeline stages (the packed and budget plans then cut
    whole groups of PP micro-batches); ``ranks()``: the rank facts the plans read (:func:`rank_info`).
    """

    def __init__(self, batching: BatchingConfig, layout: ParallelLayout, interleaved: bool,
                 ranks: Callable[[], dict[str, int]] = rank_info):
        self.batching = batching
        self.layout = layout
        self.interleaved = interleaved
        self.ranks = ranks
        self.config_prefix = "batching"  # what errors call these settings
        self.begin_pass()

    def seq_multiple(self) -> int:
        return self.layout.tp if self.layout.use_sequence_parallel else 1

    def plan(self, batch: RLBatch, rows: torch.Tensor, mbs: int, what: str) -> MicroBatchPlan:
        """How the pass over ``rows`` (global ids into ``batch``) is cut (``engine/packing.py``)."""
        b = self.batching
        return make_plan(
            rows, batch.attention_mask[rows].sum(1), dp=self.ranks()["dp"], micro_batch_size=mbs,
            seq_len=batch.seq_len, pack=b.pack_sequences, max_tokens=b.max_tokens_per_micro_batch,
            multiple=self.seq_multiple(), key=f"{self.config_prefix}.max_tokens_per_micro_batch", what=what,
            micro_multiple=self.layout.pp if self.interleaved else 1,
        )

    def micro_batches(self, batch: RLBatch, rows: torch.Tensor, mbs: int, what: str) -> tuple[RLBatch, list[dict]]:
        """This DP rank's micro-batches of the pass over ``rows``, as dicts of the rows' tensors
        (``[n, S]``, what the losses read) plus, when packed, ``packed`` (a :class:`PackedRow`) and
        ``model`` (the packed ``[1, T]`` model inputs). Returns the batch the dicts index: with a
        dummy row appended when the plan needs one (row id ``batch_size``)."""
        plan = self.plan(batch, rows, mbs, what)
        dummy = batch.batch_size
        if plan.has_dummy:
            batch, _ = batch.padded_rows(dummy + 1)
        self._pass_stats += torch.tensor([plan.real_tokens, plan.token_slots, plan.micro_batches_per_rank],
                                         dtype=torch.float64)
        tensors = {k: v for k, v in batch.tensors().items() if k != "group_ids"}
        lengths = batch.attention_mask.sum(1)
        dev = device()
        out = []
        for ids in plan.micro[self.ranks()["dp_rank"]]:
            ids = torch.where(ids == DUMMY, torch.full_like(ids, dummy), ids)
            mb = {k: v[ids].to(dev) for k, v in tensors.items()}
            mb["rows"] = ids
            if plan.packed:
                mb["packed"] = self._packed_inputs(batch, ids, lengths[ids], plan.seq_len, mb)
            out.append(mb)
        return batch, out

    @staticmethod
    def _packed_inputs(batch: RLBatch, ids: torch.Tensor, lengths: torch.Tensor, seq_len: int, mb: dict):
        """Pack the rows ``ids`` into one ``[1, T]`` row: the model's inputs go to ``mb['model']``."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from ..bridge.local_spec import PLAN_ATTR, build_attention_plan

        dev = device()
        p = PackedRow.build(ids, lengths, seq_len)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=p.cu_seqlens.to(dev), cu_seqlens_kv=p.cu_seqlens.to(dev),
            max_seqlen_q=p.max_seqlen, max_seqlen_kv=p.max_seqlen,
        )
        # the TE-less attention's gather plan, from the host's boundaries: its layers read nothing back
        setattr(params, PLAN_ATTR, build_attention_plan(p.cu_seqlens, dev))
        model = {"input_ids": p.pack(batch.input_ids).to(dev), "position_ids": p.pack_positions().to(dev),
                 "packed_seq_params": params}
        if "routed_experts" in mb:  # the rows' routes, already gathered in the order of ids
            local = PackedRow.build(torch.arange(len(ids)), lengths, seq_len)
            model["routed_experts"] = local.pack(mb["routed_experts"], fill=-1).to(dev)
        mb["model"] = model
        return p.to(dev)

    def begin_pass(self) -> None:
        self._pass_stats = torch.zeros(3, dtype=torch.float64)  # real tokens, token slots, micro-batches per rank

    def metrics(self) -> dict[str, float]:
        """How the last call (an update or a forward pass) was cut: ``batching/padding_frac``
        (padding among the token positions the model computed, all ranks), ``batching/micro_batches``
        (forward passes each DP rank ran, over all mini-batches and epochs; the ``param_grad``
        pass repeats them) and ``batching/tokens`` (real tokens processed, all ranks)."""
        real, slots, micro = self._pass_stats.tolist()
        return {
            "batching/padding_frac": 1.0 - real / slots if slots else 0.0,
            "batching/micro_batches": micro,
            "batching/tokens": real,
        }

    def forward_batch(self, batch: RLBatch, rows: Optional[torch.Tensor] = None) -> tuple[RLBatch, torch.Tensor, int]:
        """``batch`` padded for a forward-only pass over ``rows`` (global ids, None = every row),
        the rows the pass plans over, and its micro-batch size. Padding: the sequence multiple;
        over every row with fixed-size micro-batches, rows to a multiple of DP x micro-batch;
        else (packing, a token budget, or some rows) a dummy row where the plan needs one."""
        mbs = self.batching.forward_micro_batch_size or self.batching.micro_batch_size
        batch = batch.padded_seq(self.seq_multiple())
        if rows is not None:
            return batch, rows, mbs
        if not (self.batching.pack_sequences or self.batching.max_tokens_per_micro_batch):
            batch, _ = batch.padded_rows(self.ranks()["dp"] * mbs)
        return batch, torch.arange(batch.batch_size), mbs

    def forward_micro_batches(self, batch: RLBatch, rows: Optional[torch.Tensor] = None) -> tuple[RLBatch, list[dict]]:
        """The padded batch of a forward-only pass over ``rows`` (:meth:`forward_batch`) and this
        rank's micro-batches of it; a pass of its own (:meth:`begin_pass`)."""
        self.begin_pass()
        batch, rows, mbs = self.forward_batch(batch, rows)
        return self.micro_batches(batch, rows, mbs, "batching.forward_micro_batch_size")

    def update_rows(self, n: int, step: int) -> list[torch.Tensor]:
        """The rows of every mini-batch of an update of ``n`` rows starting at optimizer step ``step``."""
        return update_rows(n, self.batching, step)

    def dp_rows(self, batch: RLBatch, step: int, *, forward: bool = True, update: bool = True) -> list[torch.Tensor]:
        """Sorted global ids of the rows each data-parallel rank's micro-batches read in a
        forward-only pass over every row (``forward``) and then an update (``update``) of
        ``batch`` starting at optimizer step ``step``: the plans those passes make, from the rows'
        lengths alone (every rank computes the same). What the batch transfer sends each rank
        (``batch_transfer.py``)."""
        batch = batch.filled()
        b0 = batch.batch_size
        plans = []
        if forward:
            fb, rows, mbs = self.forward_batch(batch)
            plans.append(self.plan(fb, rows, mbs, "batching.forward_micro_batch_size"))
        if update:
            ub = batch.padded_seq(self.seq_multiple())
            mbs = self.batching.micro_batch_size
            plans += [self.plan(ub, rows, mbs, "batching.mini_batch_size") for rows in self.update_rows(b0, step)]
        return rows_by_rank(plans, self.ranks()["dp"], b0)
