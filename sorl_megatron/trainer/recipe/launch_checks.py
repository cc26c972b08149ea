"""The recipe checks that need the launch: the world size and the model's HF config.

``train.py`` runs them after the schema (``config.py``) and before any process group or
server starts; ``--print-config`` skips them (it needs neither).
"""

from __future__ import annotations

from types import SimpleNamespace

from ...bridge.layout import num_experts_of
from ...bridge.te_fp8 import Fp8Error, require_fp8
from .config import RecipeError, TrainConfig


def validate_layout_for_launch(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need the world size and the model's HF config (heads, experts, layers).

    Reads ``<model.path>/config.json`` (and ``model.critic_path``'s when set): a missing one is
    an error. The layout rules are bridge/layout.py's ``validate_layout`` (the ones the
    engines apply when they build), run early, with errors naming the recipe keys to change.
    """
    try:  # TE and an FP8-capable GPU: here, not in the schema, so --print-config works anywhere
        require_fp8(cfg.model.fp8)
    except Fp8Error as err:
        raise RecipeError(str(err)) from None
    p = cfg.parallelism
    mp = p.tp * p.pp
    if world_size % mp:
        raise RecipeError(
            f"parallelism: tp x pp = {p.tp} x {p.pp} = {mp} does not divide the world size {world_size}"
        )
    models = [("model.path", cfg.model.path)]
    if cfg.model.critic_path and cfg.algorithm.advantage.estimator == "gae":
        models.append(("model.critic_path", cfg.model.critic_path))
    for key, path in models:
        hf_config = _load_hf_config(key, path)
        _check_model_layout(cfg, hf_config, key)
        _check_layout_rules(cfg, hf_config, key, world_size)
    dp = world_size // mp
    s = cfg.schedule
    if s.pack_sequences:
        return  # packed micro-batches are dealt to the DP ranks whatever the row count
    if s.max_tokens_per_micro_batch is not None:
        if s.mini_batch_size % dp:
            raise RecipeError(f"schedule.mini_batch_size={s.mini_batch_size} must be a multiple of the "
                              f"data-parallel size {dp} (token-budget micro-batches of padded rows)")
        return
    if s.mini_batch_size % (s.micro_batch_size * dp):
        raise RecipeError(
            f"schedule.mini_batch_size={s.mini_batch_size} must be a multiple of "
            "schedule.micro_batch_size x data-parallel size "
            f"= {s.micro_batch_size} x {dp}"
        )


def validate_model_for_plan(cfg: TrainConfig, hf_config, source: str) -> None:
    """The layout rules that need only the model (heads, vocabulary, layers, experts against
    tp, pp, vpp, ep), for ``--print-memory``: a plan of a layout that cannot run is no plan.
    ``source`` names where the config came from (``--model-config=...``, ``model.path=...``);
    ``hf_config`` is its JSON as attributes, experts under any family's name."""
    from .memory_plan import routed_experts

    _check_model_layout(cfg, SimpleNamespace(**{**vars(hf_config), "num_experts": routed_experts(hf_config)}), source)


def _load_hf_config(key: str, path: str):
    from ...bridge.hf_config import load_hf_config

    try:
        return load_hf_config(path)
    except FileNotFoundError as err:
        raise RecipeError(f"{key}: {err}") from None
    except (OSError, ValueError) as err:  # unreadable JSON, unknown model_type, rope scaling
        raise RecipeError(f"{key}: cannot use the HF config of {path} ({err})") from None


def _check_model_layout(cfg: TrainConfig, hf_config, key: str) -> None:
    """The common mistakes, with messages in config keys (validate_layout covers the rest)."""
    p = cfg.parallelism
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    layers = int(hf_config.num_hidden_layers)
    experts = num_experts_of(hf_config)
    if heads % p.tp or kv % p.tp:
        raise RecipeError(
            f"parallelism.tp={p.tp} does not divide the model's {heads} attention / {kv} KV heads ({key})"
        )
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    if vocab % p.tp:
        # megatron shards the (unpadded) embedding and output layer over TP
        raise RecipeError(
            f"parallelism.tp={p.tp} does not divide the model's vocab_size {vocab} (pad the vocabulary; {key})"
        )
    if not p.uneven and layers % (p.pp * p.vpp):
        raise RecipeError(f"parallelism.pp x vpp = {p.pp * p.vpp} does not divide the model's {layers} layers "
                          f"({key}; uneven stages: parallelism.first_stage_layers / last_stage_layers)")
    if p.ep > 1 and experts == 0:
        raise RecipeError(f"parallelism.ep={p.ep} needs an MoE model; {key} is dense")
    if p.ep > 1 and experts % p.ep:
        raise RecipeError(f"parallelism.ep={p.ep} does not divide the model's {experts} experts ({key})")
    if key == "model.path" and cfg.algorithm.routing_replay != "off" and experts == 0:
        raise RecipeError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay} needs an MoE model; {cfg.model.path} is dense"
        )
    if key == "model.path" and cfg.rollout.inject.route_flip_fraction > 0 and experts == 0:
        raise RecipeError(f"rollout.inject.route_flip_fraction needs an MoE model; {cfg.model.path} is dense")


def _check_layout_rules(cfg: TrainConfig, hf_config, key: str, world_size: int) -> None:
    """bridge/layout.py's rules (expert layout vs the world size, expert FFN vs ETP, ...)."""
    from ...bridge.layout import LayoutError, UnsupportedModelError, validate_layout

    layout = p = cfg.parallelism
    stages = f", first_stage_layers={p.first_stage_layers}, last_stage_layers={p.last_stage_layers}" * p.uneven
    where = (f"parallelism (tp={p.tp}, pp={p.pp}, vpp={p.vpp}, ep={p.ep}, etp={p.etp}{stages}) "
             f"at world size {world_size} for {key}={getattr(cfg.model, key.split('.')[1])}")
    try:
        validate_layout(layout, hf_config, world_size)
    except UnsupportedModelError as err:
        raise RecipeError(f"{key}: {err}") from None
    except LayoutError as err:
        named = ", ".join(f"parallelism.{k}={getattr(p, k)}" for k in err.keys)  # the keys to change
        raise RecipeError(f"{named + ': ' if named else ''}{where}: {err}") from None
    if num_experts_of(hf_config) and layout.tp > 1 and not layout.use_sequence_parallel:
        # bridge/build.py refuses this when it builds the model
        raise RecipeError(
            f"parallelism.sequence_parallel=false with tp={p.tp}: MoE models need sequence parallelism under TP"
        )
