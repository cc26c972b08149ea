"""The engines of one RL run, built from the recipe: the actor, the reference (only with a KL
penalty) and the critic (only for critic estimators such as GAE)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..algorithms import ADVANTAGE_ESTIMATORS
from ..engine.actor import ActorConfig, PolicyEngine
from ..engine.config import BatchingConfig
from ..engine.critic import CriticConfig, ValueEngine
from .recipe.config import TrainConfig
from .recipe.model_options import model_options


@dataclass
class RunEngines:
    actor: PolicyEngine
    ref: Optional[PolicyEngine] = None
    critic: Optional[ValueEngine] = None


def optimizer_steps(cfg: TrainConfig, epochs: int) -> int:
    """Optimizer steps of the whole run for an engine updating ``epochs`` times per batch."""
    s = cfg.schedule
    return s.total_steps * max(1, s.batch_size * cfg.rollout.group_size // s.mini_batch_size) * epochs


def build_engines(cfg: TrainConfig, policy_path: str) -> RunEngines:
    """The run's engines on ``policy_path`` (the critic on ``model.critic_path`` when set)."""
    s, layout, options = cfg.schedule, cfg.parallelism, model_options(cfg)
    batching = BatchingConfig(
        epochs=s.ppo_epochs, mini_batch_size=s.mini_batch_size, micro_batch_size=s.micro_batch_size,
        shuffle=True, seed=s.seed, pack_sequences=s.pack_sequences,
        max_tokens_per_micro_batch=s.max_tokens_per_micro_batch,
    )
    engines = RunEngines(PolicyEngine(policy_path, layout, ActorConfig(
        loss=cfg.algorithm.loss, optim=cfg.optimizer.actor(optimizer_steps(cfg, s.ppo_epochs)), batching=batching,
        routing_replay=cfg.algorithm.routing_replay, temperature=cfg.rollout.temperature), model_options=options))
    if cfg.algorithm.loss.kl_coef > 0:
        engines.ref = PolicyEngine(policy_path, layout, ActorConfig(
            loss=cfg.algorithm.loss, batching=batching, temperature=cfg.rollout.temperature),
            trainable=False, model_options=options)
    if ADVANTAGE_ESTIMATORS[cfg.algorithm.advantage.estimator].critic:
        critic_batching = dataclasses.replace(batching, epochs=s.critic_epochs, seed=s.seed + 1)
        engines.critic = ValueEngine(cfg.model.critic_path or policy_path, layout, CriticConfig(
            optim=cfg.optimizer.critic(optimizer_steps(cfg, s.critic_epochs)), batching=critic_batching,
            value_clip=cfg.algorithm.value_clip, loss_agg=cfg.algorithm.loss.loss_agg), model_options=options)
    for engine in (engines.actor, engines.ref, engines.critic):
        if engine is not None:
            engine.config_prefix = "schedule"  # batching errors name the recipe's keys
    return engines
