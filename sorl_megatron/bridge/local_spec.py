"""GPT layer specs: TransformerEngine's when it imports, else a local one with TE's names.

mbridge's HF<->Megatron name maps are written against the TE spec, where the input norm is
fused into the QKV linear (`linear_qkv.layer_norm_weight`), the dense MLP norm into fc1
(`linear_fc1.layer_norm_weight`) and the experts are grouped linears (`linear_fc1.weight{i}`).
Megatron's own local spec names these differently (`input_layernorm.weight`,
`local_experts.{i}.linear_fc1.weight`), which the maps reject. The modules below compute
the same thing with plain torch ops and expose TE's parameter names, so checkpoints, name
maps and the dist-checkpoint keys are identical whichever spec built the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from .grouped_gemm import EXPERT_GEMMS, DeviceCounts, expert_linear
from .te_probe import transformer_engine_available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF Qwen2/Llama/Mixtral RMSNorm, so float32 logits match bit for bit.
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class LocalRMSNorm(torch.nn.Module):
    """RMSNorm that, unlike megatron's WrappedTorchNorm, also runs under sequence parallel."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"local spec supports RMSNorm only, got {config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_param_device(config))
        )
        # The input is a sequence shard: grads differ per TP rank and finalize_model_grads
        # all-reduces params carrying this flag.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _param_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class LocalLayerNormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm followed by ColumnParallelLinear, named like TELayerNormColumnParallelLinear."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"local spec supports RMSNorm only, got {config.normalization!r}")
        kwargs.pop("tp_comm_buffer_name", None)
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm_eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype, device=_param_device(config))
        )
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        # The norm runs on the (sequence-parallel) shard; ColumnParallelLinear gathers after.
        normed = rms_norm(input_, self.layer_norm_weight, self.norm_eps)
        return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)


class _LocalGroupedLinear(torch.nn.Module):
    """Per-expert weights `weight0..weight{n-1}` applied to contiguous token groups.

    Matches TE's GroupedLinear as megatron uses it for experts: no communication inside
    (the token dispatcher does it), output/input dim divided by the expert-TP size. The product
    is ``grouped_gemm.expert_linear``: one ``torch._grouped_mm`` where torch has it for the
    device and dtype, else one ``F.linear`` per expert (``expert_gemm``: ``auto`` / ``loop``).
    """

    partition_dim: int = 0  # 0: column parallel (split outputs), 1: row parallel (split inputs)

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Any,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection: Any = None,
        expert_gemm: str = "auto",
    ):
        super().__init__()
        if expert_gemm not in EXPERT_GEMMS:
            raise ValueError(f"expert_gemm must be one of {EXPERT_GEMMS}, got {expert_gemm!r}")
        self.expert_gemm = expert_gemm
        if bias:
            raise ValueError("local grouped expert linears have no bias support (add_bias_linear must be False)")
        if not is_expert:
            raise ValueError("grouped linears are only used for experts")
        from megatron.core.process_groups_config import ProcessGroupCollection

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.config = config
        self.num_gemms = num_gemms
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        etp = self._tp_group.size() if self._tp_group is not None else 1
        self.expert_parallel = config.expert_model_parallel_size > 1
        if self.partition_dim == 0:
            out_local, in_local = _divide(output_size, etp), input_size
        else:
            out_local, in_local = output_size, _divide(input_size, etp)
        device = _param_device(config)
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for i in range(num_gemms):
                w = torch.empty(out_local, in_local, dtype=config.params_dtype, device=device)
                if config.perform_initialization:
                    init_method(w)
                param = torch.nn.Parameter(w)
                # Expert grads are reduced over the expert-DP group, not all of DP.
                param.allreduce = not self.expert_parallel
                # As TE's GroupedLinear: always a TP shard, at ETP = 1 too. Otherwise megatron's
                # grad norm takes an ETP = 1 expert for a duplicate on every TP rank but the first
                # and drops it (ETP != TP: wrong norm, wrong clipping).
                param.tensor_model_parallel = True
                param.partition_dim = self.partition_dim
                param.partition_stride = 1
                self.register_parameter(f"weight{i}", param)

    def forward(self, x: torch.Tensor, m_splits):
        """``m_splits``: rows per expert, a list of ints (megatron's) or a tensor on any device."""
        weights = list(self._parameters.values())  # weight0..weight{n-1}, registration order
        return expert_linear(x, weights, m_splits, self.expert_gemm), None

    def backward_dw(self) -> None:
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        # Same keys/offsets as TE's grouped linear: one tensor per global expert id.
        metadata = metadata or {}
        ep = self._pg_collection.ep
        ep_size, ep_rank = (ep.size(), ep.rank()) if ep is not None else (1, 0)
        num_global = ep_size * self.num_gemms
        ep_axis = len(sharded_offsets)
        dp_cp_group = metadata.get("dp_cp_group")
        if dp_cp_group is None:
            from megatron.core import parallel_state

            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        out = {}
        for i in range(self.num_gemms):
            global_idx = ep_rank * self.num_gemms + i
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": getattr(self, f"weight{i}")},
                "",
                {f"{i}.weight": self.partition_dim},
                (*sharded_offsets, (ep_axis, global_idx, num_global)),
                tp_group=self._tp_group,
                dp_cp_group=dp_cp_group,
            )
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
        expt_dp = self._pg_collection.expt_dp
        edp_rank = expt_dp.rank() if expt_dp is not None else 0
        for sh_ten in out.values():
            sh_ten.replica_id = (*sh_ten.replica_id[:2], edp_rank)
        return out


class LocalGroupedMLP(TEGroupedMLP):
    """Megatron's grouped-expert MLP (pure torch but for its linears) whose linears receive the
    tokens per expert as a device tensor (``grouped_gemm.DeviceCounts``) instead of the host
    list megatron reads per layer; FP8 / FP4 (TE only) keep megatron's list."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not (self.config.fp8 or self.config.fp4) and isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = DeviceCounts(tokens_per_expert)
        return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)


class LocalColumnParallelGroupedLinear(_LocalGroupedLinear):
    partition_dim = 0


class LocalRowParallelGroupedLinear(_LocalGroupedLinear):
    partition_dim = 1


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by expert tensor parallel size {d}")
    return n // d


def _length_classes(lengths: torch.Tensor, ratio: float = 1.5) -> torch.Tensor:
    """A class per segment: segments within a factor ``ratio`` of length share one."""
    return torch.ceil(torch.log(lengths.double().clamp(min=1)) / math.log(ratio)).long()


class LocalDotProductAttention(DotProductAttention):
    """Megatron's DotProductAttention that also takes packed sequences (THD, ``cu_seqlens``).

    Megatron's own refuses ``packed_seq_params`` (only TE's attention runs THD). Here each
    segment attends causally within itself: segments of similar length (within 1.5x) are
    gathered into a right-padded ``[len, n, heads, dim]`` block and run through the causal
    attention of :meth:`_attend`, then scattered back; padding keys sit after every real query,
    so the causal mask alone hides them. This is the per-document causal mask of packed
    training without building a ``[T, T]`` mask, at the attention cost of the unpacked rows.
    :meth:`_attend` is megatron's unfused softmax attention here (``model.local_attention:
    unfused``); :class:`LocalSdpaAttention` runs torch's fused kernel instead.
    """

    def __init__(self, *args: Any, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs: Any):
        # MLA passes its q/k and v head sizes (TE's attention takes them; megatron's local one
        # does not). Only the value size shapes the output; MLA passes softmax_scale itself.
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    def _attend(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None):
        """Attention of ``[s, b, heads, dim]`` inputs to ``[s, b, heads * v_dim]``; the mask is
        megatron's (True = hidden), None = the layer's mask type alone (causal here)."""
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return self._attend(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            fmt = packed_seq_params.qkv_format
            raise ValueError(f"local attention takes packed sequences in THD format, got {fmt!r}")
        plan = packed_attention_plan(packed_seq_params, query.device)
        if plan.tokens != query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {plan.tokens} but the packed sequence has {query.shape[0]} tokens")
        outputs = []
        for idx, keep, mask in plan.blocks:
            ctx = self._attend(query[idx], key[idx], value[idx], mask[None, None], attn_mask_type)
            outputs.append(ctx.flatten(0, 1).index_select(0, keep))  # not ctx[valid]: a host read
        return torch.cat(outputs)[plan.order]


@dataclass
class PackedAttentionPlan:
    """How :class:`LocalDotProductAttention` gathers a packed row's segments: per length class a
    ``[width, n]`` index of the rows to gather (padding reads a real row), the flat positions of
    its real (not padding) entries and the ``[width, width]`` causal mask; ``order`` puts the
    classes' outputs back in token order."""

    tokens: int
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    order: torch.Tensor


PLAN_ATTR = "sorl_attention_plan"  # where a PackedSeqParams keeps its plan: every layer reuses it


def packed_attention_plan(params: Any, device: torch.device) -> PackedAttentionPlan:
    """The plan of ``params.cu_seqlens_q``, built on the host once per packed row (the segment
    widths are shapes: the host must know them) and kept on ``params``, so the layers of a
    micro-batch read nothing back from the device. The engine builds it before the pass
    (``MicroBatcher``) from the host's boundaries; otherwise the first layer does."""
    plan = getattr(params, PLAN_ATTR, None)
    if plan is None or plan.order.device != device:
        cu, cu_kv = params.cu_seqlens_q.cpu(), params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu, cu_kv.cpu()):
            raise ValueError("local packed attention is self-attention: cu_seqlens_q must equal cu_seqlens_kv")
        plan = build_attention_plan(cu, device)
        setattr(params, PLAN_ATTR, plan)
    return plan


def build_attention_plan(cu: torch.Tensor, device: torch.device) -> PackedAttentionPlan:
    cu = cu.to(dtype=torch.long)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    classes = _length_classes(lengths)
    positions, blocks = [], []
    for c in torch.unique(classes).tolist():  # a handful of length classes, never tokens
        sel = (classes == c) & (lengths > 0)
        if not bool(sel.any()):
            continue
        width = int(lengths[sel].max())
        t = torch.arange(width)
        idx = starts[sel].unsqueeze(0) + t.unsqueeze(1)  # [width, n]: segment-major columns
        valid = t.unsqueeze(1) < lengths[sel].unsqueeze(0)
        idx = torch.where(valid, idx, starts[sel].unsqueeze(0))  # padding reads a real row (masked)
        mask = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)
        positions.append(idx[valid])
        keep = valid.flatten().nonzero().flatten()
        blocks.append(tuple(x.to(device) for x in (idx, keep, mask)))
    order = torch.argsort(torch.cat(positions)) if positions else torch.zeros(0, dtype=torch.long)
    return PackedAttentionPlan(int(cu[-1]), blocks, order.to(device))


class LocalSdpaAttention(LocalDotProductAttention):
    """:class:`LocalDotProductAttention` with torch's ``scaled_dot_product_attention`` (the
    default, ``model.local_attention: sdpa``): flash / memory-efficient kernels on a GPU without
    TE (no ``[b, heads, s, s]`` score tensor), a fused kernel on the CPU (3-6x megatron's
    unfused attention at the demo's shapes, benchmarks/bench_attention.py). Same function up to
    float rounding (~1e-6, tests/bridge/test_local_attention.py). Settings torch's kernel does
    not have (attention dropout while training, sliding windows, softmax offsets, a bias,
    query-key layer scaling) fall back to megatron's unfused path."""

    def _sdpa_supported(self, attention_bias) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (attention_bias is None and dropout == 0.0 and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None and not self.config.apply_query_key_layer_scaling)

    def _attend(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None):
        if not self._sdpa_supported(attention_bias):
            return super()._attend(query, key, value, attention_mask, attn_mask_type, attention_bias)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim]
        # no mask: the mask type's own, as megatron's softmax; else megatron's True hides a key, torch's keeps it
        keep = None if attention_mask is None else attention_mask.logical_not()
        causal = keep is None and mask_type == AttnMaskType.causal and sq > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


LOCAL_ATTENTION = {"sdpa": LocalSdpaAttention, "unfused": LocalDotProductAttention}


def _attention_spec(qk_layernorm: bool, local_attention: str) -> ModuleSpec:
    qk_norm = LocalRMSNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=LocalLayerNormColumnParallelLinear,
            core_attention=LOCAL_ATTENTION[local_attention],
            linear_proj=RowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def _mla_attention_spec(local_attention: str) -> ModuleSpec:
    """Multi-latent attention (DeepSeek-V3) with TE's parameter names.

    TE's spec fuses the q / kv latent norms into the up projections
    (`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`) and keeps the
    down projections unsplit (TELinear, 'duplicated'). Here the down projections are
    ColumnParallelLinear (megatron's MLA gathers their output over TP and scatters it back to the
    sequence shard), so their weights are split over TP on CPU while TE replicates them; the
    dist-checkpoint keys carry global shapes either way.
    """
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules

    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=LocalLayerNormColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=LocalLayerNormColumnParallelLinear,
            core_attention=LOCAL_ATTENTION[local_attention],
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            kv_layernorm=IdentityOp,
        ),
    )


def local_layer_spec(moe: bool, qk_layernorm: bool, mla: bool = False, local_attention: str = "sdpa",
                     expert_gemm: str = "auto") -> ModuleSpec:
    """One decoder layer, TE-named: dense layers fuse the MLP norm into fc1; MoE layers keep
    `pre_mlp_layernorm` (as TE's spec does) and use grouped expert linears (``expert_gemm``:
    ``grouped_gemm``'s mode). MLA layers keep a separate `input_layernorm` (TE's MLA spec does:
    its q / kv down projections are plain linears)."""
    if moe:
        gemm = {"expert_gemm": expert_gemm}
        experts = ModuleSpec(
            module=LocalGroupedMLP,  # megatron's pure-torch TEGroupedMLP; only its linears come from TE normally
            submodules=MLPSubmodules(
                linear_fc1=ModuleSpec(module=LocalColumnParallelGroupedLinear, params=gemm),
                linear_fc2=ModuleSpec(module=LocalRowParallelGroupedLinear, params=gemm),
            ),
        )
        shared = ModuleSpec(
            module=SharedExpertMLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
        mlp = ModuleSpec(
            module=MoELayer,
            submodules=MoESubmodules(experts=experts, shared_experts=shared),
            metainfo={"fuse_pre_mlp_layernorm": False},
        )
        pre_mlp_norm: Any = LocalRMSNorm
    else:
        mlp = ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=LocalLayerNormColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
        pre_mlp_norm = IdentityOp
    attention = _mla_attention_spec(local_attention) if mla else _attention_spec(qk_layernorm, local_attention)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LocalRMSNorm if mla else IdentityOp,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None, use_te: Optional[bool] = None,
                       local_attention: str = "sdpa", expert_gemm: str = "auto"):
    """Block spec for this pipeline stage: TE's if TE imports (or use_te=True), else local."""
    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    # Let megatron decide which layers live on this stage and which are MoE, then swap in
    # the TE-named local modules layer by layer.
    stock = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    mla = bool(getattr(config, "multi_latent_attention", False))
    dense = local_layer_spec(moe=False, qk_layernorm=config.qk_layernorm, mla=mla, local_attention=local_attention)
    moe = local_layer_spec(moe=True, qk_layernorm=config.qk_layernorm, mla=mla, local_attention=local_attention,
                           expert_gemm=expert_gemm)
    layers = [moe if spec.submodules.mlp.module is MoELayer else dense for spec in stock.layer_specs]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalRMSNorm)
