"""Parallel layouts and the checks that reject impossible ones.

Pure Python (no megatron import): the checks run before any process group or model is
created, so a bad layout fails in milliseconds with a message naming the numbers involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .families import (
    SUPPORTED_MODEL_TYPES,  # noqa: F401 (re-exported: sorl_megatron.bridge.SUPPORTED_MODEL_TYPES)
    FamilyConfigError,
    check_family,
    first_k_dense,
    is_supported,
    shared_expert_size,
    supported_model_types,
)

# The HF `model_type` values this package builds and has tested on CPU are the registered
# families (families/, one module each). mbridge registers more (mimo, glm4v, gemma3, ...):
# refused up front.


class LayoutError(ValueError):
    """A parallel layout that cannot work for this model or this world size.

    ``keys``: the layout fields (``tp``, ``pp``, ``vpp``, ``ep``, ``etp``, ``cp``,
    ``first_stage_layers``, ``last_stage_layers``) to change,
    so that a caller can name its own keys for them (the recipe's ``parallelism.*``).
    """

    def __init__(self, message: str, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = tuple(keys)


class UnsupportedModelError(ValueError):
    """An HF architecture this package cannot build."""


@dataclass(frozen=True)
class ParallelLayout:
    """How one model is split over ranks. The process group's bounds (the timeouts) and the memory
    keys (gpu_memory_gib, recompute, planned_world_size) ride along: they are not part of the
    layout, and equality ignores them.

    Attributes:
        tp: tensor-parallel size (it divides the attention and KV heads and the FFN sizes).
        pp: pipeline-parallel stages (1 = off).
        vpp: virtual stages per pipeline rank (megatron's interleaved schedule; 1 = off, > 1 needs pp > 1).
        ep: expert-parallel size (MoE models; it divides the routed experts).
        etp: expert tensor-parallel size (None = same as tp, megatron's default).
        cp: context-parallel size; only 1 is supported (a larger one is refused at launch).
        sequence_parallel: megatron's sequence parallelism, only ever on with tp > 1; None = on
            whenever tp > 1 (MoE layers require it with TP).
        first_stage_layers / last_stage_layers: uneven pipeline stages (megatron's
            ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``): the
            decoder layers of the first / last pipeline rank, the other layers split evenly over the
            middle ranks; needs pp > 1. None = even split. With VPP each pipeline rank's layers split
            evenly over its chunks.
        collective_timeout_s: every collective's timeout in seconds (the NCCL watchdog's).
        rank0_phase_timeout_s: how long, in seconds, the other ranks wait for a phase only rank 0 runs
            (rollouts, validation, PVPO's reference pass, SFT's demonstrations) before they stop naming it.
        gpu_memory_gib: the per-GPU budget in GiB a GPU run's memory estimate must fit
            (trainer/recipe/memory_plan.py); None: the device's reported memory.
        recompute: activation recomputation (megatron's recompute_granularity): none; selective = its
            default core-attention modules; full = every layer (uniform).
        planned_world_size: the GPUs the recipe is laid out for: the world size of the weight-sync
            plan and of the memory plan without WORLD_SIZE (None: the smallest world the layout needs).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    cp: int = 1
    sequence_parallel: Optional[bool] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    collective_timeout_s: float = field(default=1800.0, compare=False)
    rank0_phase_timeout_s: float = field(default=7200.0, compare=False)
    gpu_memory_gib: Optional[float] = field(default=None, compare=False)
    recompute: Literal["none", "selective", "full"] = field(default="none", compare=False)
    planned_world_size: Optional[int] = field(default=None, compare=False)

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers of each pipeline rank, first to last (megatron's split; unchecked:
        `validate_layout` refuses the splits that do not add up)."""
        if not self.uneven:
            return [num_layers // self.pp] * self.pp
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_ranks, rest = self.middle_stages(num_layers)
        each = rest // middle_ranks if middle_ranks > 0 else 0
        return ([first] if first is not None else []) + [each] * middle_ranks + ([last] if last is not None else [])

    def middle_stages(self, num_layers: int) -> tuple[int, int]:
        """Pipeline ranks between the sized first / last stages, and the layers left for them."""
        first, last = self.first_stage_layers, self.last_stage_layers
        return self.pp - (first is not None) - (last is not None), num_layers - (first or 0) - (last or 0)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def use_sequence_parallel(self) -> bool:
        if self.sequence_parallel is None:
            return self.tp > 1
        return bool(self.sequence_parallel) and self.tp > 1

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}"]
        if self.uneven:
            ends = [f"{k} {v}" for k, v in (("first", self.first_stage_layers), ("last", self.last_stage_layers))
                    if v is not None]
            parts[-1] += f" ({', '.join(ends)} layers)"
        if self.vpp > 1:
            parts.append(f"VPP={self.vpp}")
        if self.ep > 1 or self.etp is not None:
            parts.append(f"EP={self.ep}")
            parts.append(f"ETP={self.expert_tp}")
        if self.cp > 1:
            parts.append(f"CP={self.cp}")
        if self.use_sequence_parallel:
            parts.append("SP")
        return " ".join(parts)

    @classmethod
    def from_string(cls, text: str) -> "ParallelLayout":
        """Parse 'tp=2,pp=1,ep=2' (keys: tp pp vpp ep etp cp sp first_stage_layers last_stage_layers)."""
        values: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            if "=" not in item:
                raise LayoutError(f"layout item {item!r} is not key=value (in {text!r})")
            key, value = (s.strip().lower() for s in item.split("=", 1))
            if key == "sp":
                values["sequence_parallel"] = value in ("1", "true", "yes", "on")
            elif key in ("tp", "pp", "vpp", "ep", "etp", "cp", "first_stage_layers", "last_stage_layers"):
                try:
                    values[key] = int(value)
                except ValueError:
                    raise LayoutError(f"layout {key}={value!r} is not an integer") from None
            else:
                raise LayoutError(f"unknown layout key {key!r} in {text!r}; use tp,pp,vpp,ep,etp,cp,sp,"
                                  "first_stage_layers,last_stage_layers")
        return cls(**values)


def _cfg(hf_config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return default


def check_pipeline_split(layout: ParallelLayout, layers: int, name: str = "the model") -> None:
    """Megatron's rules for splitting `layers` over PP (x VPP) stages, even or uneven
    (TransformerConfig.__post_init__ and transformer_block.get_num_layers_to_build), as
    LayoutErrors naming the keys before megatron would assert."""
    stages = layout.pp * layout.vpp
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if not layout.uneven:
        if layers % stages:
            raise LayoutError(
                f"PP={layout.pp} x VPP={layout.vpp} = {stages} stages do not divide num_hidden_layers={layers} "
                f"of {name} (uneven stages: first_stage_layers / last_stage_layers)",
                ("pp", "vpp") if layout.vpp > 1 else ("pp",),
            )
        return
    given = tuple(k for k, v in (("first_stage_layers", first), ("last_stage_layers", last)) if v is not None)
    for key in given:
        value = getattr(layout, key)
        if value < 1:
            raise LayoutError(f"{key}={value} must be >= 1", (key,))
        if value % layout.vpp:
            raise LayoutError(f"VPP={layout.vpp} does not divide {key}={value} (each pipeline rank's layers "
                              "split evenly over its virtual stages)", (key, "vpp"))
    if layout.pp == 1:
        raise LayoutError(f"{' / '.join(given)} need PP > 1 (they size the first / last pipeline stage)",
                          (*given, "pp"))
    middle_ranks, rest = layout.middle_stages(layers)
    split = f"{layers} layers = " + " + ".join(
        [f"first {first}"] * (first is not None) + [f"{rest} over {middle_ranks} middle ranks"]
        + [f"last {last}"] * (last is not None)
    )
    if middle_ranks == 0 and rest:
        raise LayoutError(
            f"first_stage_layers + last_stage_layers = {first + last} must equal num_hidden_layers={layers} "
            f"of {name} at PP=2 (no middle ranks take the rest)", (*given, "pp"))
    if rest < 0 or (rest == 0) != (middle_ranks == 0):
        raise LayoutError(
            f"{' and '.join(f'{k}={getattr(layout, k)}' for k in given)} leave {rest} layers for {middle_ranks} "
            f"middle pipeline ranks at PP={layout.pp} ({split} of {name}; each rank needs at least one layer)",
            (*given, "pp"),
        )
    if middle_ranks and rest % middle_ranks:
        raise LayoutError(
            f"the {rest} layers left by {' and '.join(f'{k}={getattr(layout, k)}' for k in given)} do not split "
            f"evenly over the {middle_ranks} middle pipeline ranks of PP={layout.pp} ({name})", (*given, "pp"))
    if middle_ranks and (rest // middle_ranks) % layout.vpp:
        raise LayoutError(f"VPP={layout.vpp} does not divide the {rest // middle_ranks} layers of each middle "
                          f"pipeline rank ({split} of {name})", ("vpp", *given))


def megatron_pipeline_split(layout: ParallelLayout) -> dict:
    """TransformerConfig fields for an uneven split (empty when even). With PP=2, first and last
    both given, only the first is passed: megatron's interleaved layer offset divides by the
    number of middle ranks (0 // 0, transformer_layer.get_transformer_layer_offset), and the
    last rank as the lone "middle" rank gets the same layers."""
    if not layout.uneven:
        return {}
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if layout.pp == 2 and first is not None and last is not None:
        last = None
    return {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last}


def num_experts_of(hf_config: Any) -> int:
    """Routed experts per MoE layer (0 for dense). Qwen-MoE: num_experts; Mixtral: num_local_experts."""
    return int(_cfg(hf_config, "num_experts", "num_local_experts", default=0) or 0)


def validate_layout(layout: ParallelLayout, hf_config: Any, world_size: Optional[int] = None) -> None:
    """Raise LayoutError / UnsupportedModelError when `layout` cannot run `hf_config`.

    Called before process groups exist: everything here is arithmetic on the config.
    """
    model_type = getattr(hf_config, "model_type", None)
    if not is_supported(model_type):
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={getattr(hf_config, 'architectures', None)}); "
            f"supported: {', '.join(supported_model_types())}"
        )
    try:
        check_family(hf_config)
    except FamilyConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    for key in ("tp", "pp", "vpp", "ep", "cp"):
        if getattr(layout, key) < 1:
            raise LayoutError(f"{key}={getattr(layout, key)} must be >= 1", (key,))
    if layout.etp is not None and layout.etp < 1:
        raise LayoutError(f"etp={layout.etp} must be >= 1", ("etp",))
    if layout.cp != 1:
        raise LayoutError("context parallelism (cp > 1) is not supported by this package yet", ("cp",))

    heads = int(hf_config.num_attention_heads)
    kv_heads = int(_cfg(hf_config, "num_key_value_heads", default=heads))
    layers = int(hf_config.num_hidden_layers)
    name = f"{model_type} ({layers} layers, {heads} heads, {kv_heads} kv heads)"
    if heads % layout.tp:
        raise LayoutError(f"TP={layout.tp} does not divide num_attention_heads={heads} of {name}", ("tp",))
    if kv_heads % layout.tp:
        raise LayoutError(
            f"TP={layout.tp} does not divide num_key_value_heads={kv_heads} of {name} "
            "(KV-head replication is not supported)", ("tp",)
        )
    if layout.vpp > 1 and layout.pp == 1:
        raise LayoutError(f"VPP={layout.vpp} needs PP > 1 (interleaving splits pipeline stages)", ("vpp", "pp"))
    check_pipeline_split(layout, layers, name)
    experts = num_experts_of(hf_config)
    if experts == 0:
        if layout.ep > 1 or (layout.etp not in (None, layout.tp)):
            raise LayoutError(f"EP={layout.ep}/ETP={layout.etp} given for dense model {name}",
                              ("ep",) if layout.ep > 1 else ("etp",))
    else:
        if experts % layout.ep:
            raise LayoutError(f"EP={layout.ep} does not divide num_experts={experts} of {name}", ("ep",))
        ffn = int(_cfg(hf_config, "moe_intermediate_size", "intermediate_size"))
        if ffn % layout.expert_tp:
            raise LayoutError(f"ETP={layout.expert_tp} does not divide expert ffn size {ffn} of {name}"
                              + ("" if layout.etp is not None else " (ETP defaults to TP)"), ("etp",))
        if layout.tp == 1 and layout.expert_tp > 1:
            # mbridge 0.15.1's export (_weight_merge_across_tp) returns the first shard unmerged when
            # TP is 1, so every weight sync and HF export would fail its assertion on the experts
            raise LayoutError(f"ETP={layout.expert_tp} with TP=1: mbridge 0.15.1 exports expert-TP shards only "
                              f"when TP > 1; use etp=1 (experts whole on each EP rank) or tp={layout.expert_tp}",
                              ("etp", "tp"))
    shared = shared_expert_size(hf_config)
    if shared and shared % layout.tp:
        raise LayoutError(f"TP={layout.tp} does not divide the shared-expert ffn size {shared} of {name}", ("tp",))
    ffn_dense = _cfg(hf_config, "intermediate_size")
    if (experts == 0 or first_k_dense(hf_config)) and ffn_dense is not None and int(ffn_dense) % layout.tp:
        raise LayoutError(f"TP={layout.tp} does not divide intermediate_size={ffn_dense} of {name}", ("tp",))
    if world_size is not None:
        mp = layout.model_parallel_size
        if world_size % mp:
            raise LayoutError(
                f"world size {world_size} is not a multiple of TP x PP x CP = {mp} ({layout.describe()})",
                ("tp", "pp"),
            )
        dp = world_size // mp
        # Experts re-split the same ranks: ETP x EP x expert-DP x PP must equal the world size.
        expert_mp = layout.expert_tp * layout.ep * layout.pp
        if world_size % expert_mp:
            raise LayoutError(
                f"world size {world_size} is not a multiple of ETP x EP x PP = {expert_mp} "
                f"({layout.describe()})", ("ep", "etp")
            )
        if layout.tp * layout.cp * dp % (layout.expert_tp * layout.ep):
            raise LayoutError(
                f"ETP x EP = {layout.expert_tp * layout.ep} must divide TP x CP x DP = "
                f"{layout.tp * layout.cp * dp} ({layout.describe()}, world size {world_size})", ("ep", "etp")
            )
