"""The RL loop: rollouts -> rewards -> old/ref log-probs, values -> advantages -> actor and
critic updates -> weight sync -> validation -> checkpoint.

Every rank runs the Megatron engines; rank 0 alone talks HTTP for rollouts, retrieval and
health (and broadcasts each step's batch to the other ranks, which then cut their own
data-parallel rows), except in the distributed weight sync, where every sending rank announces
its own buckets to the servers (docs/rollout.md). The off-policyness is explicit in the recipe: ``schedule.batch_size x
rollout.group_size`` trajectories per step, split into mini-batches of
``schedule.mini_batch_size`` (one optimizer step each) over ``schedule.ppo_epochs`` epochs
(SORL appendix A.5). Everything is seeded per step, so a run killed at any point and resumed
from its latest checkpoint reproduces the uninterrupted run on CPU.

``rollout.mode`` (``sync``, ``one_step_off``, ``async``) decides when a step's groups are
generated and so how many weight versions behind they may be (``rollout.max_staleness``);
``producer.py`` holds the groups, their bookkeeping across checkpoints and the async producer
(docs/rollout.md, "Rollout modes"). Only ``sync`` and ``one_step_off`` reproduce exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import PreTrainedTokenizerBase

from ..algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from ..bridge.model import ModelOptions
from ..bridge.parallel import init_distributed
from ..bridge.weights import iter_hf_weights, save_hf_checkpoint
from ..common.clock import ActiveClock
from ..common.fp8 import quantize_hf_tensor
from ..common.http import RetryPolicy, ServerError
from ..common.typed_config import to_dict
from ..data.gold import cold_start_plans, gold_plan, gold_trajectory
from ..data.qa import QARow, encode_prompt
from ..engine.actor import ActorConfig, PolicyEngine
from ..engine.checkpoint import (
    complete_checkpoints,
    load_engine_checkpoint,
    newest_checkpoint,
    read_checkpoint_meta,
    save_engine_checkpoint,
)
from ..engine.config import BatchingConfig, OptimConfig
from ..engine.critic import CriticConfig, ValueEngine
from ..engine.rl_batch import RLBatch
from ..retrieval.client import RetrievalClient
from ..rewards.registry import RewardRegistry
from ..rollout.agent import AgentConfig, SearchAgent
from ..rollout.client import PauseClock, RolloutClient, RolloutClientConfig
from ..rollout.trajectory import Trajectory, collate
from .config import TrainConfig, dump_config
from .fleet import RolloutFleet, Worker, start_fleet
from .inputs import check_resume_dir, load_tokenizer, validate_inputs
from .metrics_log import MetricsLogger, open_wandb
from .producer import (
    AsyncProducer,
    Group,
    SettledGroups,
    apply_overlong,
    equal_rewards,
    version_lag_metrics,
)
from .pvpo import PVPOState, group_sampling, inject_ground_truth, reference_statistics
from .rollout_phase import (
    RolloutResult,
    check_prompt_length,
    collect_rollouts,
    rollout_metrics,
    score_trajectories,
)
from .servers import EmbeddedServers, retrieval_server_spec, rollout_server_spec
from .sft import run_sft
from .weight_sync import DistributedWeightSync

log = logging.getLogger("sorl_megatron.trainer")


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    """Rank 0's object on every rank (our own ranks: pickling between them is safe)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj if _rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def start_message(cfg: TrainConfig, resume: Optional[Path], step: int) -> tuple[bool, str]:
    """Whether a run has steps left to train, and the line that says what it does: start,
    resume (from which step of how many), or nothing because it is finished (and then how to
    extend it or start over)."""
    name, total = cfg.logging.run_name, cfg.schedule.total_steps
    run_dir = Path(cfg.logging.dir) / name
    if resume is None:
        return True, f"starting run {name}: {total} RL steps, logs and checkpoints in {run_dir}"
    if step < total:
        return True, f"resuming run {name} from step {step} of {total} ({resume})"
    from .run_settings import rerun_command  # imported here: edits of this module stay in this function

    def command(override: str) -> str:  # the command as it was typed (make demo ARGS=..., python -m ...)
        typed = rerun_command(override)
        return f"`{typed}`" if typed else f"the same command with {override}"

    o = cfg.optimizer
    if o.lr_schedule != "constant" and o.decay_steps is None:
        extend = (f"its LR schedule (optimizer.lr_schedule={o.lr_schedule}) decays over the run's length, so it "
                  "cannot be extended")
    else:
        extend = f"to train it further, run {command(f'schedule.total_steps={max(step, total) + total}')}"
    return False, (
        f"run {name} is finished: its checkpoint {resume} is at step {step} of schedule.total_steps={total}. "
        f"Nothing to do; {extend}; to start over, run {command('checkpoint.resume=none')}, remove {run_dir} or "
        "pick another logging.run_name"
    )


@dataclass
class DataStream:
    """Deterministic prompt batches: epoch-wise permutations seeded by (seed, epoch)."""

    indices: list[int]
    batch_size: int
    seed: int
    shuffle: bool = True

    def batch(self, step: int) -> list[int]:
        if not self.indices:
            raise ValueError("no training prompts left (PVPO group sampling may have dropped them all)")
        n = len(self.indices)
        pos = torch.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, i = pos // n, pos % n
        if self.shuffle:  # one permutation per epoch the batch touches (usually one, at most a few)
            for epoch in epochs.unique().tolist():
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
                here = epochs == epoch
                i[here] = order[i[here]]
        return [self.indices[k] for k in i.tolist()]


def tokens_per_second(times: dict[str, float], tokens: dict[str, Optional[float]]) -> dict[str, float]:
    """``time/<pass>_tokens_per_s``: real tokens an engine pass processed over its timed seconds."""
    out = {}
    for name, n in tokens.items():
        seconds = times.get(f"time/{name}", 0.0)
        if n is not None and seconds > 0:
            out[f"time/{name}_tokens_per_s"] = n / seconds
    return out


def _turn_versions(t: Trajectory) -> list[int]:
    """The version of each policy turn's first token (the server's per-request version)."""
    if t.token_versions is None:
        return []
    return [int(t.token_versions[a]) for a, _ in t.policy_spans()]


def _truncate_jsonl(path: Path, step: int) -> None:
    """Drop the rows of steps after ``step`` (a resumed run logs them again)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


@dataclass
class StepTimer:
    times: dict[str, float] = field(default_factory=dict)

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[f"time/{name}"] = timer.times.get(f"time/{name}", 0.0) + time.perf_counter() - self.t0

        return _Ctx()


class RLTrainer:
    """Owns the engines, the servers and the loop of one run.

    All state is declared here. What a run builds later starts empty and is set once, before
    the loop reads it: the data and tokenizer (:meth:`run`), the engines (:meth:`build_engines`)
    and the server URLs, which only rank 0 holds (it alone talks HTTP).
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.dir) / cfg.logging.run_name
        self.ckpt_root = Path(cfg.checkpoint.dir)
        self.rewards = RewardRegistry(metric_override=cfg.reward.metric, format_weight=cfg.reward.format_weight)
        # data (run)
        self.rows: list[QARow] = []
        self.val_rows: list[QARow] = []
        self.stream = DataStream([], cfg.schedule.batch_size, cfg.schedule.seed, cfg.data.shuffle)
        self.tokenizer: Optional[PreTrainedTokenizerBase] = None
        self.pad_id = 0
        # engines (build_engines)
        self.actor: Optional[PolicyEngine] = None
        self.ref: Optional[PolicyEngine] = None  # only with a KL penalty
        self.critic: Optional[ValueEngine] = None  # only for critic estimators (GAE)
        # servers (rank 0)
        self.retrieval_url: Optional[str] = None
        self.rollout_urls: list[str] = []  # every worker: weight updates, flush_cache, health
        self.fleet: Optional[RolloutFleet] = None  # the workers, the router, failures and restarts
        self.api_keys: dict[str, str] = {}  # of the embedded servers; others: $SORL_*_API_KEY
        # PVPO
        self.pvpo: Optional[PVPOState] = None
        self._gold_cache: dict[int, Optional[Trajectory]] = {}  # ground truth by prompt index (None: none usable)
        self.wandb_run: Any = None  # rank 0, with logging.wandb.mode online / offline (run)
        self._wsync = DistributedWeightSync(cfg.rollout)  # rollout.weight_sync=distributed: groups, senders
        self.weight_sync_bytes = 0  # sent by this rank in the last distributed sync
        # rollout modes (rank 0; producer.py): the groups finished steps trained on or dropped,
        # the next group a sync / one-step-off batch draws, one_step_off's batch in the making,
        # async's producer, the servers' busy clock and whether they pause for weight updates
        self.settled = SettledGroups()
        self.next_gid = 0
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Optional[concurrent.futures.Future] = None
        self._producer: Optional[AsyncProducer] = None
        self.busy = ActiveClock()  # episodes in flight: the servers' busy time
        self._pause_supported: Optional[bool] = None
        # paused time does not count against a /generate call's rollout.timeout_s (at most
        # rollout.weight_sync_timeout_s per call): a turn paused for a slow sync is not timed out
        self.pause_clock = PauseClock(cfg.rollout.weight_sync_timeout_s)

    # -- set-up ------------------------------------------------------------------------

    def _model_options(self) -> ModelOptions:
        dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.model.dtype]
        return ModelOptions(dtype=dtype)

    def _optimizer_steps(self, epochs: int) -> int:
        """Optimizer steps of the whole run for an engine updating ``epochs`` times per batch."""
        s = self.cfg.schedule
        return s.total_steps * max(1, s.batch_size * self.cfg.rollout.group_size // s.mini_batch_size) * epochs

    def build_engines(self, policy_path: str) -> None:
        cfg, s = self.cfg, self.cfg.schedule
        layout, options = cfg.parallelism, self._model_options()
        batching = BatchingConfig(
            epochs=s.ppo_epochs, mini_batch_size=s.mini_batch_size, micro_batch_size=s.micro_batch_size,
            shuffle=True, seed=s.seed, pack_sequences=s.pack_sequences,
            max_tokens_per_micro_batch=s.max_tokens_per_micro_batch,
        )
        self.actor = PolicyEngine(policy_path, layout, ActorConfig(
            loss=cfg.algorithm.loss, optim=cfg.optimizer.actor(self._optimizer_steps(s.ppo_epochs)), batching=batching,
            routing_replay=cfg.algorithm.routing_replay, temperature=cfg.rollout.temperature), model_options=options)
        if cfg.algorithm.loss.kl_coef > 0:
            self.ref = PolicyEngine(policy_path, layout, ActorConfig(
                loss=cfg.algorithm.loss, batching=batching, temperature=cfg.rollout.temperature),
                trainable=False, model_options=options)
        if ADVANTAGE_ESTIMATORS[cfg.algorithm.advantage.estimator].critic:
            critic_batching = dataclasses.replace(batching, epochs=s.critic_epochs, seed=s.seed + 1)
            self.critic = ValueEngine(cfg.model.critic_path or policy_path, layout, CriticConfig(
                optim=cfg.optimizer.critic(self._optimizer_steps(s.critic_epochs)), batching=critic_batching,
                value_clip=cfg.algorithm.value_clip, loss_agg=cfg.algorithm.loss.loss_agg), model_options=options)
        for engine in (self.actor, self.ref, self.critic):
            if engine is not None:
                engine.config_prefix = "schedule"  # batching errors name the recipe's keys

    # -- checkpoints -------------------------------------------------------------------

    def latest_checkpoint(self) -> Optional[Path]:
        if self.cfg.checkpoint.resume == "none":
            return None
        if self.cfg.checkpoint.resume != "auto":
            path = Path(self.cfg.checkpoint.resume)
            if not (path / "trainer.json").is_file():
                raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no trainer.json)")
            return path
        return newest_checkpoint(self.ckpt_root)  # verified; a damaged newer one is skipped with a warning

    def checkpoint_step(self, path: Path) -> int:
        """The RL step a checkpoint was saved after (its ``trainer.json``; nothing else is read)."""
        _, _, extra = read_checkpoint_meta(path)
        try:
            return int(extra["step"])
        except (KeyError, TypeError, ValueError):
            raise FileNotFoundError(f"{path}/trainer.json: no trainer step (not a training run's checkpoint)") from None

    def complete_checkpoints(self) -> list[Path]:
        """``step_<k>`` checkpoints whose save finished, oldest first (not ``.tmp`` / ``.old``)."""
        return complete_checkpoints(self.ckpt_root)

    def save(self, step: int) -> None:
        extra = {"step": step, "producer": self.settled.to_json()}
        if self.pvpo is not None:
            extra["pvpo"] = {"static_v": self.pvpo.static_v, "accuracy": self.pvpo.accuracy,
                             "refreshed_at_step": self.pvpo.refreshed_at_step, "keep": self.stream.indices}
        save_engine_checkpoint(str(self.ckpt_root / f"step_{step}"), self.actor, self.critic, extra=extra)
        if _rank() == 0 and self.cfg.checkpoint.keep_last > 0:
            for old in self.complete_checkpoints()[: -self.cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def restore(self, path: Path) -> int:
        extra = load_engine_checkpoint(str(path), self.actor, self.critic)
        if "pvpo" in extra:
            p = extra["pvpo"]
            self.pvpo = PVPOState(
                {int(k): v for k, v in p["static_v"].items()},
                {int(k): v for k, v in p["accuracy"].items()},
                p["refreshed_at_step"],
            )
            self.stream.indices = list(p["keep"])
        step = int(extra["step"])
        # older checkpoints: each step trained on batch_size groups, in order
        self.settled = SettledGroups.from_json(
            extra.get("producer") or {"frontier": step * self.cfg.schedule.batch_size})
        self.next_gid = self.settled.frontier
        return step

    # -- rollouts ----------------------------------------------------------------------

    def _agent_config(self, greedy: bool = False, routed_experts: Optional[bool] = None) -> AgentConfig:
        """The agent loop's limits and sampling, from the recipe (greedy: validation)."""
        r = self.cfg.rollout
        if routed_experts is None:
            routed_experts = self.cfg.algorithm.routing_replay == "r3"
        return AgentConfig(
            max_turns=r.max_turns, max_turn_tokens=r.max_turn_tokens, max_total_tokens=r.max_total_tokens,
            max_obs_tokens=r.max_obs_tokens, topk=self.cfg.retrieval.topk,
            temperature=r.temperature, top_p=1.0 if greedy else r.top_p, top_k=1 if greedy else r.top_k,
            return_routed_experts=routed_experts, max_concurrency=r.concurrency,
        )

    def _rollout_client(self) -> RolloutClient:
        """The one way the trainer talks to the rollout servers (generation, weight sync,
        health); every wait is bounded by the recipe's ``rollout.*`` timeouts and retries."""
        r, fleet = self.cfg.rollout, self._fleet()
        return RolloutClient(RolloutClientConfig(
            urls=tuple(self.rollout_urls), max_concurrency=r.concurrency,
            generate_retry=RetryPolicy(timeout_s=r.timeout_s, retries=r.retries),
            control_retry=RetryPolicy(timeout_s=r.weight_sync_timeout_s, retries=r.retries),
            health_retry=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries),
            api_key=self.api_keys.get("rollout"), router_url=fleet.router_url,
            failover_retries=r.failover_retries), on_failure=fleet.on_failure,
            serving=fleet.urls,  # a long-lived (async) client follows restarts
            on_retry=lambda: fleet.count("retries"),  # as they happen, from any thread
            pauses=self.pause_clock if r.mode == "async" and r.pause_mode != "off" else None)  # only async pauses

    def _fleet(self) -> RolloutFleet:
        """The run's fleet; one made of ``rollout_urls`` (external servers, no router) when
        they were set without one."""
        if self.fleet is None:
            r = self.cfg.rollout
            self.fleet = RolloutFleet(
                timeout_s=r.start_timeout_s, health=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries),
                run_dir=self.run_dir, workers=[], restart_command=r.restart_command,
                api_key=self.api_keys.get("rollout"))
        if not self.fleet.workers:
            self.fleet.workers = [Worker(u) for u in self.rollout_urls]
        return self.fleet

    def _retrieval_client(self) -> RetrievalClient:
        """The one way the trainer talks to the retrieval server, bounded by ``retrieval.*``."""
        q = self.cfg.retrieval
        return RetrievalClient(self.retrieval_url, topk=q.topk, api_key=self.api_keys.get("retrieval"),
                               policy=RetryPolicy(timeout_s=q.timeout_s, retries=q.retries),
                               health_policy=RetryPolicy(timeout_s=q.health_timeout_s, retries=q.retries))

    def check_servers(self, phase: str, retrieval: bool = True) -> None:
        """Before ``phase``: every server it uses answers ``GET /health`` within the recipe's
        ``*.health_timeout_s``, else a ``ServerError`` naming the server, what failed and the
        phase. Asked even when the policy never searches, so a dead retrieval server is noticed
        at once. Rank 0 alone talks HTTP; the checks of both servers run at once."""
        if _rank() != 0:
            return
        when = f"before {phase}"

        async def go():
            clients = [self._retrieval_client()] if retrieval and self.retrieval_url else []
            # the rollout workers that fail are taken out (and restarted); an error only when none is left
            checks = [self._fleet().check(when)] if self.rollout_urls else []
            try:
                results = await asyncio.gather(*checks, *(c.check_health(when) for c in clients),
                                               return_exceptions=True)
            finally:
                for c in clients:
                    await c.close()
            if self.fleet is not None:
                self.rollout_urls = self.fleet.urls()
            errors = [r for r in results if isinstance(r, BaseException)]
            if len(errors) > 1 and all(isinstance(e, ServerError) for e in errors):
                raise ServerError("; ".join(str(e) for e in errors))
            if errors:
                raise errors[0]

        asyncio.run(go())

    def rollouts(
        self, indices: list[int], n: int, seed: int, greedy: bool = False, rows=None, rewards=None
    ) -> RolloutResult:
        """``n`` episodes for each of ``rows[i]`` (default: the training rows and rewards)."""
        rows = self.rows if rows is None else rows
        rewards = self.rewards if rewards is None else rewards

        async def go():
            policy, retriever = self._rollout_client(), self._retrieval_client()
            agent = SearchAgent(policy, retriever, self.tokenizer, self._agent_config(greedy))
            try:
                return await collect_rollouts(
                    agent,
                    self.tokenizer,
                    [rows[i] for i in indices],
                    indices,
                    n,
                    rewards,
                    seed=seed,
                    max_prompt_tokens=self.cfg.data.max_prompt_tokens,
                )
            finally:
                await policy.close()
                await retriever.close()

        return asyncio.run(go())

    # -- groups: what every rollout mode draws (producer.py) -----------------------------

    def group_prompt(self, gid: int) -> int:
        """Dataset index of group ``gid``: position ``gid % batch_size`` of the stream's batch
        ``gid // batch_size`` (the prompts a sync run always drew)."""
        b = self.cfg.schedule.batch_size
        return self.stream.batch(gid // b)[gid % b]

    def group_seed(self, gid: int) -> int:
        """Seed of group ``gid``'s first episode (the next ones add 1, 2, ...): the seeds a
        sync run always gave that batch position."""
        b, n = self.cfg.schedule.batch_size, self.cfg.rollout.group_size
        return self.cfg.schedule.seed * 1_000_003 + gid // b + (gid % b) * n

    async def _open_groups(self):
        """``(run_group, close)`` on the running event loop: ``run_group(gid)`` plays one group."""
        policy, retriever = self._rollout_client(), self._retrieval_client()
        agent = SearchAgent(policy, retriever, self.tokenizer, self._agent_config())

        async def run_group(gid: int) -> Group:
            prompt = self.group_prompt(gid)
            ids = encode_prompt(self.tokenizer, self.rows[prompt])
            check_prompt_length(ids, prompt, self.cfg.data.max_prompt_tokens)
            self.busy.enter()
            try:
                trajs = await agent.run_many([ids], n=self.cfg.rollout.group_size, seed=self.group_seed(gid),
                                             metas=[{"group": gid, "prompt": prompt}])
            finally:
                self.busy.exit()
            return Group(gid, prompt, trajs)

        async def close() -> None:
            await policy.close()
            await retriever.close()

        return run_group, close

    def _draw_groups(self, count: int) -> list[Group]:
        """The next ``count`` groups from ``next_gid`` on, generated now (sync, one_step_off)."""
        gids = list(range(self.next_gid, self.next_gid + count))
        self.next_gid += count

        async def go():
            run_group, close = await self._open_groups()
            try:
                return await asyncio.gather(*(run_group(g) for g in gids))
            finally:
                await close()

        return list(asyncio.run(go()))

    def _score_group(self, group: Group) -> int:
        """Rewards, overlong handling and PVPO ground truth of one group (in place); returns the
        episodes the overlong option touched."""
        r = self.cfg.rollout
        n = len(group.trajectories)
        group.rewards = score_trajectories(group.trajectories, [self.rows[group.prompt]] * n, self.rewards)
        touched = apply_overlong(group, r.overlong, r.max_total_tokens, r.overlong_buffer, r.overlong_penalty)
        group.injected = torch.zeros(n, dtype=torch.bool)
        if self.pvpo is not None and self.cfg.algorithm.pvpo.inject_ground_truth:
            unsolved = group_sampling(self.pvpo).unsolved
            if group.prompt in set(unsolved):
                gids = torch.full((n,), group.prompt, dtype=torch.long)
                group.trajectories, group.injected = inject_ground_truth(
                    group.trajectories, gids, group.rewards, self.gold_for([group.prompt]), unsolved)
                group.rewards = torch.where(group.injected, torch.ones_like(group.rewards), group.rewards)
        return touched

    def _collect(
        self, version: int, draw, slots: Optional[AsyncProducer] = None
    ) -> tuple[list[Group], list[tuple[Group, str]], dict[str, float]]:
        """A batch of ``schedule.batch_size`` groups for a trainer at weight ``version``:
        ``draw(k)`` gives the next k generated groups. A group whose oldest token is more than
        ``rollout.max_staleness`` versions behind is dropped (or kept, ``stale_groups=keep``);
        with dynamic sampling a group whose rewards are all equal is dropped and replaced, at
        most ``dynamic_sampling_max_groups`` drawn, then dropped ones fill the batch. Returns
        the batch, every group drawn but not trained on with why, and the counts. ``slots`` (async:
        the producer) gets a dropped group's window slot back at once, and takes back the slots
        of dropped groups that fill the batch after all (they train: the window bound holds)."""
        r, b = self.cfg.rollout, self.cfg.schedule.batch_size
        limit = (r.dynamic_sampling_max_groups or 4 * b) if r.dynamic_sampling else None
        accepted: list[Group] = []
        dropped: list[tuple[Group, str]] = []
        counts = {"rollout/groups_drawn": 0.0, "rollout/groups_dropped_stale": 0.0,
                  "rollout/episodes_dropped_stale": 0.0, "rollout/groups_kept_stale": 0.0,
                  "rollout/overlong_episodes": 0.0}
        if r.dynamic_sampling:
            counts.update({"rollout/groups_dropped_equal_reward": 0.0, "rollout/groups_refilled_equal_reward": 0.0})
        while len(accepted) < b:
            want = b - len(accepted)
            if limit is not None:
                want = min(want, limit - int(counts["rollout/groups_drawn"]))
                if want <= 0:
                    break
            for group in draw(want):
                counts["rollout/groups_drawn"] += 1
                oldest = group.oldest_version
                if oldest is not None and version - oldest > r.max_staleness:
                    if r.stale_groups == "drop":
                        counts["rollout/groups_dropped_stale"] += 1
                        counts["rollout/episodes_dropped_stale"] += len(group.trajectories)
                        dropped.append((group, "stale"))
                        if slots is not None:
                            slots.release([group.gid])
                        continue
                    counts["rollout/groups_kept_stale"] += 1
                counts["rollout/overlong_episodes"] += self._score_group(group)
                if r.dynamic_sampling and equal_rewards(group):
                    counts["rollout/groups_dropped_equal_reward"] += 1
                    dropped.append((group, "equal_reward"))
                    if slots is not None:
                        slots.release([group.gid])
                    continue
                accepted.append(group)
        if len(accepted) < b:  # dynamic sampling ran out of draws: equal-reward groups fill the batch
            fill = [g for g, why in dropped if why == "equal_reward"][: b - len(accepted)]
            counts["rollout/groups_refilled_equal_reward"] = float(len(fill))
            counts["rollout/groups_dropped_equal_reward"] -= len(fill)  # dropped: not trained on
            accepted += fill
            if slots is not None:
                slots.hold([g.gid for g in fill])
            dropped = [(g, why) for g, why in dropped if not any(g is f for f in fill)]
        return accepted, dropped, counts

    def _collect_sync(self, version: int):
        """A batch generated now, from ``next_gid`` on (sync; one_step_off in its thread)."""
        self.check_servers(f"the rollout phase of step {version + 1}")
        return self._collect(version, self._draw_groups)

    def _collect_async(self, version: int):
        """A batch from the producer's finished groups (started on first use)."""
        if self._producer is None:
            r = self.cfg.rollout
            self.check_servers("the asynchronous rollouts")
            self._producer = AsyncProducer(self._open_groups, self.settled.unsettled_from(self.settled.frontier),
                                           window=(r.max_staleness + 1) * self.cfg.schedule.batch_size).start()
        timeout = self.cfg.rollout.timeout_s * (self.cfg.rollout.max_turns + 1)
        return self._collect(version, lambda k: [self._producer.take(timeout) for _ in range(k)],
                             slots=self._producer)

    def close_rollouts(self) -> None:
        """Stop the one-step-off thread and the async producer (their groups are not settled:
        a resumed run draws them again)."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._pending = None

    def _next_batch(self, step: int) -> tuple[tuple, dict[str, float]]:
        """Rank 0: step ``step``'s groups by ``rollout.mode`` and the trainer's idle seconds."""
        mode, t0 = self.cfg.rollout.mode, time.perf_counter()
        if mode == "async":
            out = self._collect_async(step)
        elif mode == "one_step_off" and self._pending is not None:
            out = self._pending.result()
            self._pending = None
        else:  # sync, and one_step_off's first step (of a run, or after a resume)
            out = self._collect_sync(step)
        idle = time.perf_counter() - t0
        if mode == "one_step_off" and step + 1 < self.cfg.schedule.total_steps:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="one-step-off")
            # step + 1's batch, on the weights this step trains from (the sync waits for it)
            self._pending = self._executor.submit(self._collect_sync, step + 1)
        return out, {"time/trainer_idle_rollout": idle}

    def _log_episodes(self, step: int, version: int, accepted: list[Group], dropped) -> None:
        """``episodes.jsonl``: one line per group a step drew, with its episodes' turn versions."""
        with open(self.run_dir / "episodes.jsonl", "a") as f:
            for group, status in [(g, "trained") for g in accepted] + list(dropped):
                policy = [t for t in group.trajectories if not t.meta.get("ground_truth")]
                f.write(json.dumps({
                    "step": step, "group": group.gid, "prompt": group.prompt, "status": status,
                    "trainer_version": version, "oldest": group.oldest_version,
                    "turn_versions": [_turn_versions(t) for t in policy],
                    "rewards": None if group.rewards is None else [round(float(x), 6) for x in group.rewards],
                    "ground_truth": len(group.trajectories) - len(policy),
                }) + "\n")

    def sync_weights(self, step: int) -> None:
        """Push the actor's weights after ``step`` RL steps to the rollout servers (HF names,
        bucketed), labelled weight version ``step_<step>``."""
        version = f"step_{step}"
        self.check_servers(f"the weight sync to version {version}", retrieval=False)
        if _rank() == 0:
            self.rollout_urls = self._fleet().prepare_sync()  # restarted servers get this sync too
        paused = self._pause(True)
        try:
            self._push_weights(version)
        finally:
            if paused:
                self._pause(False)
        if _rank() == 0:
            self._fleet().finish_sync()  # ... and serve again: with the current weights
            self.rollout_urls = self._fleet().urls()

    def _pause(self, pause: bool) -> bool:
        """Async mode, rank 0: ``/pause_generation`` before a weight update (True when the
        servers paused), ``/continue_generation`` after. Servers without the endpoints apply the
        update between the requests they schedule, as they would anyway (docs/rollout.md)."""
        mode = self.cfg.rollout.pause_mode
        if _rank() != 0 or self.cfg.rollout.mode != "async" or mode == "off" or self._pause_supported is False:
            return False
        if not pause:  # a fresh client: it has not seen the pause, so it must be told to continue
            try:
                asyncio.run(self._with_client(lambda c: c.continue_generation(force=True)))
            finally:
                self.pause_clock.resume()
            return False
        self.pause_clock.pause()  # before the call: a server pauses as soon as it is asked
        try:
            self._pause_supported = asyncio.run(self._with_client(lambda c: c.pause_generation(mode)))
        except Exception:
            # some servers may have paused before one failed: never leave them paused
            try:
                asyncio.run(self._with_client(lambda c: c.continue_generation(force=True)))
            except Exception as err:
                log.warning("after a failed /pause_generation, /continue_generation failed too: %s", err)
            self.pause_clock.resume()
            raise
        if not self._pause_supported:
            self.pause_clock.resume()
            log.info("the rollout servers have no /pause_generation: weight updates land between their requests")
        return self._pause_supported

    def _push_weights(self, version: str) -> None:
        """The sync itself, to ``rollout_urls`` (every rank joins the export)."""
        if self.cfg.rollout.weight_sync == "distributed":
            self.weight_sync_bytes = self._wsync.sync(
                self.actor.model, self.rollout_urls, self.api_keys.get("rollout"), version)
            return
        # external servers get FP8 weights; the embedded ones quantize what they receive themselves
        fp8 = self.cfg.rollout.precision == "fp8" and bool(self.cfg.rollout.urls)
        if self.cfg.rollout.weight_sync == "disk":
            out = str((self.run_dir / "weights_sync").resolve())  # the servers resolve it, not us: absolute
            save_hf_checkpoint(self.actor.model, out, fp8=fp8)
            if _rank() == 0:
                asyncio.run(self._with_client(lambda c: c.update_weights_from_disk(out, weight_version=version)))
            return
        tensors = iter_hf_weights(self.actor.model)
        if fp8:
            tensors = (pair for name, t in tensors for pair in quantize_hf_tensor(name, t))
        if _rank() == 0:
            asyncio.run(self._with_client(lambda c: c.update_weights_from_tensor(tensors, weight_version=version)))
        else:
            for _ in tensors:  # every rank joins the gathers inside the export
                pass

    async def _with_client(self, fn):
        client = self._rollout_client()
        try:
            return await fn(client)
        finally:
            await client.close()

    # -- the step ----------------------------------------------------------------------

    def _to_batch(self, res: RolloutResult, injected: torch.Tensor):
        t = collate(res.trajectories, pad_token_id=self.pad_id)
        return RLBatch(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"], loss_mask=t["loss_mask"],
            rollout_logprobs=t["rollout_logprobs"], turn_ids=t["turn_ids"], group_ids=res.group_ids,
            routed_experts=t.get("routed_experts") if self.cfg.algorithm.routing_replay == "r3" else None,
        ), injected

    def _batch_result(self, groups: list[Group]) -> tuple[RolloutResult, torch.Tensor]:
        """The batch's trajectories (group after group: prompt-major), rows, prompt ids,
        rewards and PVPO injection marks."""
        trajs = [t for g in groups for t in g.trajectories]
        rewards = torch.cat([g.rewards for g in groups])
        res = RolloutResult(
            trajectories=trajs,
            rows=[self.rows[g.prompt] for g in groups for _ in g.trajectories],
            group_ids=torch.tensor([g.prompt for g in groups for _ in g.trajectories], dtype=torch.long),
            rewards=rewards,
            metrics=rollout_metrics(trajs, rewards),
        )
        return res, torch.cat([g.injected for g in groups])

    def advantages(self, batch: RLBatch, rewards: torch.Tensor, values: Optional[torch.Tensor]):
        """The recipe's estimator (``algorithms.advantages`` registry) on this batch."""
        a = self.cfg.algorithm.advantage
        static = self.pvpo.values_for(batch.group_ids) if self.pvpo is not None else None
        inputs = AdvantageInputs(rewards, batch.loss_mask, values, batch.group_ids, static)
        return compute_advantages(a.estimator, inputs, gamma=a.gamma, lam=a.lam, normalize_std=a.normalize_std,
                                  whiten=a.whiten)

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        timer = StepTimer()
        metrics: dict[str, float] = {}
        wall0, busy0 = time.perf_counter(), self.busy.seconds()
        with timer("rollout"):
            payload = None
            if _rank() == 0:
                (accepted, dropped, counts), idle = self._next_batch(step)
                res, injected = self._batch_result(accepted)
                res.metrics.update(counts)
                res.metrics.update(version_lag_metrics(accepted, step, cfg.rollout.max_staleness))
                # settled: a checkpoint after this step says so, and a resumed run never draws them again
                self.settled.add([g.gid for g in accepted] + [g.gid for g, _ in dropped])
                self._log_episodes(step + 1, step, accepted, dropped)
                metrics.update(idle)
                payload = (self._to_batch(res, injected), res.rewards, res.metrics)
            (batch, injected), rewards, rollout_metrics_ = _broadcast(payload)
        metrics.update(rollout_metrics_)
        metrics["rollout/injected_ground_truth"] = float(injected.sum())
        with timer("old_logprobs"):
            out = self.actor.compute_logprobs(batch, record_routing=cfg.algorithm.routing_replay == "r2")
            old = torch.where(injected[:, None], batch.rollout_logprobs, out.logprobs)  # PVPO eq. 6 for GT rows
            batch = batch.replace(old_logprobs=old)
            if cfg.algorithm.routing_replay == "r2":
                batch = batch.replace(routed_experts=out.routed_experts)
            # R3: how often the trainer's own router disagrees with the rollout engine's routes
            # (the update's actor/routing/* say the same of the replayed routes after each step)
            metrics.update({f"old/{k}": v for k, v in out.metrics.items()})
        if self.ref is not None:
            with timer("ref_logprobs"):
                batch = batch.replace(ref_logprobs=self.ref.compute_logprobs(batch).logprobs)
        values = None
        if self.critic is not None:
            with timer("values"):
                values = self.critic.compute_values(batch)
        adv, returns = self.advantages(batch, rewards, values)
        batch = batch.replace(advantages=adv)
        with timer("actor_update"):
            metrics.update({f"actor/{k}": v for k, v in self.actor.update(batch).items()})
        if self.critic is not None:
            with timer("critic_update"):
                metrics.update(
                    {
                        f"critic/{k}": v
                        for k, v in self.critic.update(batch.replace(returns=returns, values=values)).items()
                    }
                )
        if self._pending is not None:  # one_step_off: the next batch is made on these weights
            t0 = time.perf_counter()
            concurrent.futures.wait([self._pending])
            metrics["time/trainer_idle_next_batch"] = time.perf_counter() - t0
        with timer("weight_sync"):
            self.sync_weights(step + 1)
        if self._producer is not None:  # async: this step's groups free their slots for the new weights
            self._producer.release()
        metrics.update(timer.times)
        if _rank() == 0:
            wall = time.perf_counter() - wall0
            metrics["time/trainer_idle"] = sum(v for k, v in metrics.items() if k.startswith("time/trainer_idle_"))
            metrics["time/server_idle"] = max(wall - (self.busy.seconds() - busy0), 0.0)
            metrics["time/step_wall"] = wall
        if _rank() == 0:
            metrics.update(self._fleet().metrics())  # failures, retries, restarts: this step's and validation's
        metrics.update(tokens_per_second(timer.times, {
            "old_logprobs": metrics.get("old/batching/tokens"),
            "ref_logprobs": self.ref.batching_metrics()["batching/tokens"] if self.ref is not None else None,
            "values": self.critic.batching_metrics()["batching/tokens"] if values is not None else None,
            "actor_update": metrics.get("actor/batching/tokens"),
            "critic_update": metrics.get("critic/batching/tokens"),
        }))
        return metrics

    def validate(self) -> dict[str, float]:
        """Exact match of greedy episodes on the validation split (rank 0 rolls out), timed."""
        if not self.val_rows:
            return {}
        timer = StepTimer()
        payload = None
        with timer("validate"):
            if _rank() == 0:
                self.check_servers("validation")
                res = self.rollouts(list(range(len(self.val_rows))), 1, seed=0, greedy=True, rows=self.val_rows,
                                    rewards=RewardRegistry(metric_override="em"))
                payload = {
                    "val/em": float(res.rewards.mean()),
                    **rollout_metrics(res.trajectories, res.rewards, prefix="val"),
                }
                payload.pop("val/reward", None)
            payload = _broadcast(payload)
        return {**payload, **timer.times}

    def gold_for(self, indices: list[int]) -> dict[int, Any]:
        """Complete ground-truth trajectories of these prompts for PVPO injection, played once
        per prompt and kept (retrieval and gold plans do not change during a run)."""
        missing = [i for i in indices if i not in self._gold_cache]
        if missing:
            found = self.gold_trajectories(missing, complete_only=True)
            self._gold_cache.update({i: found.get(i) for i in missing})  # None: no usable ground truth
        return {i: self._gold_cache[i] for i in indices if self._gold_cache[i] is not None}

    def gold_trajectories(
        self, indices: list[int], complete_only: bool = False, plans: dict[int, Any] | None = None
    ) -> dict[int, Any]:
        """Ground-truth trajectories of the given prompts, played through the agent loop.

        ``plans`` (index -> GoldPlan) replaces the rows' own gold plans (the SFT cold start's
        demonstrations); prompts without a plan are left out. With ``complete_only`` (PVPO
        injection, which scores them 1) a plan the rollout budgets cut before its answer
        (``max_turns``, ``max_turn_tokens``, ``max_total_tokens``) is left out: it is not a
        correct trajectory."""
        cfg = self._agent_config(routed_experts=False)  # a scripted policy has no routing
        out = {}

        async def go():
            retriever = self._retrieval_client()
            try:
                for i in indices:
                    row = self.rows[i]
                    plan = plans.get(i) if plans is not None else gold_plan(row)
                    if plan is None or i in out:
                        continue  # rows without a gold plan get no injection
                    out[i] = await gold_trajectory(
                        lambda pol: SearchAgent(pol, retriever, self.tokenizer, cfg),
                        self.tokenizer,
                        encode_prompt(self.tokenizer, row),
                        plan,
                    )
            finally:
                await retriever.close()

        asyncio.run(go())
        if complete_only:
            cut = sorted(i for i, t in out.items() if t.finish_reason != "answer")
            if cut:
                log.warning(
                    "ground truth of prompt(s) %s does not reach its answer within the rollout budgets; not injected",
                    cut,
                )
            out = {i: t for i, t in out.items() if i not in set(cut)}
        return out

    # -- the run -----------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """The whole run. Its input files are checked first (``InputError``, naming the file and
        row), before any server, engine or run directory exists."""
        init_distributed()  # the ranks must be known before rank 0 alone starts servers, writes files, plays gold plans
        cfg = self.cfg
        check_resume_dir(cfg)
        resume = self.latest_checkpoint()
        found = self.checkpoint_step(resume) if resume is not None else 0
        go_on, message = start_message(cfg, resume, found)
        if not go_on:  # finished: said so before reading the data or starting a server
            if _rank() == 0:
                log.info("%s", message)
            return {}
        inputs = validate_inputs(cfg, check_corpus=_rank() == 0, rewards=self.rewards)  # rank 0 alone serves retrieval
        if _rank() == 0:
            log.info("%s", message)  # starting / resuming, once the inputs are known to be good
            if cfg.rollout.mode != "sync" and cfg.algorithm.loss.is_correction.mode == "off":
                log.warning("rollout.mode=%s trains on tokens sampled by older weights; without "
                            "algorithm.loss.is_correction.mode (tis / mis) nothing corrects for it", cfg.rollout.mode)
        self.rows, self.val_rows = inputs.train, inputs.val
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stream.indices = list(range(len(self.rows)))
        with ExitStack() as stack:
            servers = stack.enter_context(EmbeddedServers(self.run_dir))
            self.api_keys = servers.api_keys  # filled as the servers start
            if _rank() == 0:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.yaml").write_text(dump_config(cfg))
                self.wandb_run = open_wandb(cfg.logging.wandb, self.run_dir, cfg.logging.run_name, to_dict(cfg),
                                            resume=resume is not None)
                if self.wandb_run is not None:
                    stack.callback(self.wandb_run.finish)
                self.retrieval_url = cfg.retrieval.url or servers.start(
                    retrieval_server_spec(cfg.retrieval.corpus, cfg.retrieval.topk)
                )
            policy_path = self.sft_stage() if cfg.sft.enabled else cfg.model.path
            self.build_engines(policy_path)
            start = self.restore(resume) if resume is not None else 0
            # only now: a logger opened at step 0 deletes metrics.jsonl, which a resumed run continues
            logger = MetricsLogger(
                self.run_dir,
                cfg.schedule.total_steps,
                cfg.logging.tensorboard,
                cfg.logging.progress,
                enabled=_rank() == 0,
                start_step=start,
                wandb_run=self.wandb_run,
            )
            stack.callback(logger.close)
            stack.callback(self._wsync.close)
            if _rank() == 0:
                if start == 0:
                    (self.run_dir / "episodes.jsonl").unlink(missing_ok=True)
                else:
                    _truncate_jsonl(self.run_dir / "episodes.jsonl", start)
            if _rank() == 0:
                r = cfg.rollout
                self.fleet = start_fleet(r, self.run_dir, servers, lambda name: rollout_server_spec(
                    policy_path, r.precision, cfg.algorithm.routing_replay == "r3", cfg.schedule.seed, name=name,
                    health_timeout_s=r.start_timeout_s, deterministic=r.deterministic))
                stack.callback(self.fleet.close)
                self.rollout_urls = self.fleet.urls()
            stack.callback(self.close_rollouts)  # before the servers stop (callbacks run last first)
            if start > 0 or cfg.rollout.urls:
                self.sync_weights(start)  # servers hold the initial checkpoint; bring them to the trainer's weights
            first: dict[str, float] = {}
            if cfg.algorithm.advantage.estimator == "pvpo" and self.pvpo is None:
                first = self.pvpo_reference_pass()
            last: dict[str, float] = {}
            if start == 0:
                logger.log(0, {**first, **self.validate()})
            for step in range(start, cfg.schedule.total_steps):
                last = {}
                if (
                    self.pvpo is not None
                    and cfg.algorithm.pvpo.refresh_due(step)
                    and self.pvpo.refreshed_at_step < step
                ):
                    last = self.pvpo_reference_pass(step)  # refresh static V with the current policy
                last.update(self.step(step))
                done = step + 1
                if (cfg.schedule.val_every and done % cfg.schedule.val_every == 0) or done == cfg.schedule.total_steps:
                    last.update(self.validate())
                if (
                    cfg.checkpoint.save_every and done % cfg.checkpoint.save_every == 0
                ) or done == cfg.schedule.total_steps:
                    timer = StepTimer()
                    with timer("checkpoint"):
                        self.save(done)
                    last.update(timer.times)
                logger.log(done, last)
                for tag, hist in self.actor.histograms.items():  # |log r| of the update (SORL Fig. 4)
                    logger.log_histogram(done, f"actor/{tag}", hist)
            return last

    def sft_stage(self) -> str:
        """Cold-start SFT on gold trajectories; returns the HF directory RL starts from."""
        cfg, sft = self.cfg, self.cfg.sft
        out = self.run_dir / "sft_model"
        if (out / "SFT_DONE").is_file():
            return str(out)
        payload = None
        if _rank() == 0:
            plans = cold_start_plans(self.rows, sft.direct_answer_fraction, cfg.schedule.seed)
            gold = self.gold_trajectories(sorted(plans), plans=plans)
            payload = [gold[i] for i in sorted(gold)]
        trajs = _broadcast(payload)
        engine = PolicyEngine(cfg.model.path, cfg.parallelism, ActorConfig(
            loss=cfg.algorithm.loss, optim=OptimConfig(lr=sft.lr, clip_grad=cfg.optimizer.clip_grad),
            batching=BatchingConfig(mini_batch_size=sft.batch_size, micro_batch_size=cfg.schedule.micro_batch_size,
                                    pack_sequences=cfg.schedule.pack_sequences,
                                    max_tokens_per_micro_batch=cfg.schedule.max_tokens_per_micro_batch)),
            model_options=self._model_options())
        engine.config_prefix = "schedule"
        sft_log = MetricsLogger(
            self.run_dir / "sft",
            sft.steps,
            cfg.logging.tensorboard,
            cfg.logging.progress,
            enabled=_rank() == 0,
            name="sft",
            wandb_run=self.wandb_run,
        )
        try:
            run_sft(
                engine,
                trajs,
                sft.steps,
                sft.batch_size,
                cfg.schedule.seed,
                self.pad_id,
                out,
                on_step=lambda step, m: sft_log.log(
                    step, {f"sft/{k}" if not k.startswith("sft/") else k: v for k, v in m.items()}
                ),
            )
        finally:
            sft_log.close()
        del engine
        return str(out)

    def pvpo_reference_pass(self, step: int = 0) -> dict[str, float]:
        """M rollouts per prompt with the policy the rollout servers hold: static V and, at step
        0 (the initial policy), group sampling (PVPO). Later calls (``pvpo.refresh_every`` / ``refresh_at``)
        refresh static V and accuracy of the kept prompts without re-filtering them. Returns
        the ``pvpo/*`` metrics of the pass."""
        p = self.cfg.algorithm.pvpo
        timer = StepTimer()
        payload = None
        with timer("pvpo_reference"):
            if _rank() == 0:
                self.check_servers(f"the PVPO reference pass before step {step + 1}")
                res = self.rollouts(
                    self.stream.indices, p.num_ref_rollouts, seed=self.cfg.schedule.seed + 7 + 1_000_033 * step
                )
                payload = reference_statistics(res.rewards, res.group_ids, step=step)
            self.pvpo = _broadcast(payload)
        v = list(self.pvpo.static_v.values())
        metrics = {"pvpo/static_v_mean": sum(v) / max(len(v), 1)}
        if step > 0:
            log.info("PVPO: static V refreshed at step %d (mean %.3f)", step, metrics["pvpo/static_v_mean"])
            return {**metrics, **timer.times}
        split = group_sampling(self.pvpo, p.drop_solved)
        self.stream.indices = split.keep
        metrics.update(
            {"pvpo/kept": len(split.keep), "pvpo/dropped": len(split.dropped), "pvpo/unsolved": len(split.unsolved)}
        )
        log.info(
            "PVPO: %d prompts kept, %d dropped as solved, %d unsolved",
            len(split.keep),
            len(split.dropped),
            len(split.unsolved),
        )
        if p.inject_ground_truth:
            have = _broadcast(len(self.gold_for(split.unsolved)) if _rank() == 0 else None)
            metrics["pvpo/ground_truth_available"] = have
            if split.unsolved and not have:
                log.warning(
                    "PVPO: algorithm.pvpo.inject_ground_truth is on but none of the %d unsolved prompts has a complete "
                    "ground-truth trajectory (rows need extra_info.gold_searches that fit the rollout budgets): "
                    "nothing will be injected",
                    len(split.unsolved),
                )
        return {**metrics, **timer.times}
