"""Where a step's groups come from: one :class:`RolloutSource` per ``rollout.mode``.

The trainer holds one source, picked once by :func:`make_rollout_source` (the only code that
reads ``rollout.mode``), and calls ``next_batch(step)`` on rank 0, ``before_sync()`` and
``after_sync(version)`` around each weight update on every rank, and ``close()`` at the end.
A new mode is one new subclass here and one entry in ``SOURCES``, under the name its settings
have in ``recipe/rollout_modes.py``'s ``ROLLOUT_MODES``.

- ``sync``: a step's groups are generated at the start of the step, on the current weights.
- ``one_step_off``: step ``k + 1``'s batch is generated on a thread while step ``k`` trains;
  the weight sync after step ``k`` waits for it (one version behind, exactly reproducible).
- ``lagged`` (a study axis): the same, ``rollout.lagged.lag`` versions deep: step ``k`` trains on the
  batch generated on weights ``k - lag``, whatever the timing; a checkpoint holds the batches
  generated ahead (``pending_batches.py``), so both resume exactly.
- ``async``: a producer thread keeps the servers generating across weight updates, up to
  ``(rollout.staleness.max + 1) x batch`` groups ahead (``producer.AsyncProducer``).

Groups are numbered in the stream's order (``producer.py``), so every mode draws the same
prompts and seeds; the settled groups are checkpointed, so a resumed run never trains on a
group twice (docs/concepts/rollout.md, "Rollout modes").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch

from ...common import aio
from ...common.clock import ActiveClock
from ...common.http import ServerError
from ...data.qa import QARow, encode_prompt
from ...rewards.registry import RewardRegistry
from ...rollout.trajectory import Trajectory
from ..groups.producer import AsyncProducer, Group, SettledGroups, apply_overlong, equal_rewards, version_lag_metrics
from ..groups.prompts import DataStream
from ..groups.rollouts import RolloutResult, check_prompt_length, rollout_metrics, score_trajectories
from ..recipe.config import TrainConfig
from ..recipe.rollout_config import RolloutConfig
from ..recipe.rollout_modes import ROLLOUT_MODES
from ..serving.connections import Connections
from ..serving.fleet import FleetRejoining
from ..stages.drivers import PVPOStage
from . import pending_batches

log = logging.getLogger("sorl_megatron.trainer")

Batch = tuple[RolloutResult, torch.Tensor, dict[str, float]]  # episodes, PVPO injection marks, metrics


class BatchAwaitsServers(FleetRejoining):
    """A batch that could not be generated: no rollout server served (the restarted ones serve
    after the next weight sync). Its draws are undone: it starts again from group ``start_gid``."""

    def __init__(self, message: str, start_gid: int):
        super().__init__(message)
        self.start_gid = start_gid


def _turn_versions(t: Trajectory) -> list[int]:
    """The version of each policy turn's first token (the server's per-request version)."""
    if t.token_versions is None:
        return []
    return [int(t.token_versions[a]) for a, _ in t.policy_spans()]


class RolloutSource:
    """Groups for the trainer's steps; subclasses decide when they are generated.

    Every rank builds one (the checkpointed ``settled`` set lives here); rank 0 alone, which
    holds ``conn``, generates.
    """

    name = ""  # its rollout.mode (a name of ROLLOUT_MODES, whose settings say whether it trains on stale tokens)
    pauses_servers = False  # whether the servers pause generation around a weight update

    def __init__(self, cfg: TrainConfig, stream: DataStream, rows: list[QARow], rewards: RewardRegistry,
                 conn: Optional[Connections], pvpo: Optional[PVPOStage], run_dir: Path):
        self.cfg = cfg
        self.stream = stream
        self.rows = rows
        self.rewards = rewards
        self.conn = conn
        self.pvpo = pvpo
        self.run_dir = run_dir
        self.settled = SettledGroups()  # groups finished steps trained on or dropped
        self.next_gid = 0  # the next group a sync / one-step-off batch draws
        self.busy = ActiveClock()  # episodes in flight: the servers' busy time

    @classmethod
    def pauses(cls, rollout: RolloutConfig) -> bool:
        return cls.pauses_servers

    # -- the interface -----------------------------------------------------------------

    def next_batch(self, step: int) -> Batch:
        """Rank 0: step ``step``'s groups, scored and settled, with the trainer's idle seconds."""
        t0 = time.perf_counter()
        accepted, dropped, counts = self._groups(step)
        idle = time.perf_counter() - t0
        res, injected = self._batch_result(accepted)
        res.metrics.update(counts)
        res.metrics.update(version_lag_metrics(accepted, step, self.cfg.rollout.staleness.max))
        # settled: a checkpoint after this step says so, and a resumed run never draws them again
        self.settled.add([g.gid for g in accepted] + [g.gid for g, _ in dropped])
        self._log_episodes(step + 1, step, accepted, dropped)
        return res, injected, {**res.metrics, "time/trainer_idle_rollout": idle}

    def before_sync(self) -> dict[str, float]:
        """Every rank, before the weight sync after a step; returns timing metrics."""
        return {}

    def after_sync(self, version: int) -> None:
        """Every rank, after the servers hold weight ``version``."""

    def close(self) -> None:
        """Stop background generation (its groups are not settled: a resumed run draws them again)."""

    def state_json(self) -> dict:
        return self.settled.to_json()

    def load_json(self, data: dict) -> None:
        self.settled = SettledGroups.from_json(data)
        self.next_gid = self.settled.frontier

    def checkpoint_files(self) -> dict[str, bytes]:
        """Rank 0, at a checkpoint: files it holds besides ``state_json`` (path -> bytes)."""
        return {}

    def restore_files(self, ckpt_dir: Path) -> None:
        """Rank 0, on resume, after ``load_json``: what ``checkpoint_files`` saved."""

    def _groups(self, step: int) -> tuple[list[Group], list[tuple[Group, str]], dict[str, float]]:
        raise NotImplementedError

    # -- groups: what every mode draws -------------------------------------------------

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

    async def open_groups(self):
        """``(run_group, close)`` on the running event loop: ``run_group(gid)`` plays one group."""
        agent, close = self.conn.agent()

        async def run_group(gid: int) -> Group:
            prompt = self.group_prompt(gid)
            ids = encode_prompt(self.conn.tokenizer, self.rows[prompt])
            check_prompt_length(ids, prompt, self.cfg.data.max_prompt_tokens)
            self.busy.enter()
            try:
                trajs = await agent.run_many([ids], n=self.cfg.rollout.group_size, seed=self.group_seed(gid),
                                             metas=[{"group": gid, "prompt": prompt}])
            finally:
                self.busy.exit()
            return Group(gid, prompt, trajs)

        return run_group, close

    def draw_groups(self, count: int) -> list[Group]:
        """The next ``count`` groups from ``next_gid`` on, generated now."""
        gids = list(range(self.next_gid, self.next_gid + count))
        self.next_gid += count

        async def go():
            run_group, close = await self.open_groups()
            try:
                return await asyncio.gather(*(run_group(g) for g in gids))
            finally:
                await close()

        return list(aio.run(go()))

    def score_group(self, group: Group) -> int:
        """Rewards, overlong handling and PVPO ground truth of one group (in place); returns the
        episodes the overlong option touched."""
        r = self.cfg.rollout
        n = len(group.trajectories)
        group.rewards = score_trajectories(group.trajectories, [self.rows[group.prompt]] * n, self.rewards)
        touched = apply_overlong(group, r.overlong, r.max_total_tokens, r.overlong_buffer, r.overlong_penalty)
        group.injected = torch.zeros(n, dtype=torch.bool)
        if self.pvpo is not None:
            self.pvpo.inject(group)
        return touched

    def collect(
        self, version: int, draw, slots: Optional[AsyncProducer] = None, state: Optional[dict] = None
    ) -> tuple[list[Group], list[tuple[Group, str]], dict[str, float]]:
        """A batch of ``schedule.batch_size`` groups for a trainer at weight ``version``:
        ``draw(k)`` gives the next k generated groups. A group whose oldest token is more than
        ``rollout.staleness.max`` versions behind is dropped (or kept, ``rollout.staleness.stale_groups=keep``);
        with dynamic sampling a group whose rewards are all equal is dropped and replaced, at
        most ``dynamic_sampling_max_groups`` drawn, then dropped ones fill the batch. Returns
        the batch, every group drawn but not trained on with why, and the counts. ``slots`` (async:
        the producer) gets a dropped group's window slot back at once, and takes back the slots
        of dropped groups that fill the batch after all (they train: the window bound holds).
        ``state`` (a dict, empty at first) keeps the groups handled so far: a collect that ``draw``
        interrupted goes on from there when called again with it."""
        r, b = self.cfg.rollout, self.cfg.schedule.batch_size
        limit = (r.dynamic_sampling_max_groups or 4 * b) if r.dynamic_sampling else None
        state = {} if state is None else state
        if not state:
            counts = {"rollout/groups_drawn": 0.0, "rollout/groups_dropped_stale": 0.0,
                      "rollout/episodes_dropped_stale": 0.0, "rollout/groups_kept_stale": 0.0,
                      "rollout/overlong_episodes": 0.0}
            if r.dynamic_sampling:
                counts.update({"rollout/groups_dropped_equal_reward": 0.0,
                               "rollout/groups_refilled_equal_reward": 0.0})
            state.update(accepted=[], dropped=[], counts=counts)
        accepted: list[Group] = state["accepted"]
        dropped: list[tuple[Group, str]] = state["dropped"]
        counts: dict[str, float] = state["counts"]
        while len(accepted) < b:
            want = b - len(accepted)
            if limit is not None:
                want = min(want, limit - int(counts["rollout/groups_drawn"]))
                if want <= 0:
                    break
            for group in draw(want):
                counts["rollout/groups_drawn"] += 1
                oldest = group.oldest_version
                if oldest is not None and version - oldest > r.staleness.max:
                    if r.staleness.stale_groups == "drop":
                        counts["rollout/groups_dropped_stale"] += 1
                        counts["rollout/episodes_dropped_stale"] += len(group.trajectories)
                        dropped.append((group, "stale"))
                        if slots is not None:
                            slots.release([group.gid])
                        continue
                    counts["rollout/groups_kept_stale"] += 1
                counts["rollout/overlong_episodes"] += self.score_group(group)
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


class SyncSource(RolloutSource):
    """A step's groups are generated at its start, on the weights it trains from."""

    name = "sync"

    def _generate(self, version: int):
        """A batch generated now, from ``next_gid`` on (one_step_off: on its thread). With no
        rollout server serving (the only one died and was restarted) its draws are undone and
        it raises :class:`BatchAwaitsServers`: generated again once a weight sync brought a
        server back."""
        start = self.next_gid
        try:
            self.conn.check_servers(f"the rollout phase of step {version + 1}")
            return self.collect(version, self.draw_groups)
        except ServerError as err:
            if not self.conn.fleet_rejoining():
                raise
            self.next_gid = start
            raise BatchAwaitsServers(f"the batch of step {version + 1} was not generated: {err}", start) from err

    def _groups(self, step: int):
        return self._generate(step)


class LaggedSource(SyncSource):
    """Step ``k``'s batch is generated on the weights of version ``k - lag`` (``rollout.lagged.lag``):
    while step ``k`` trains, a thread generates step ``k + lag``'s batch on step ``k``'s weights,
    and the weight sync after step ``k`` waits for it. The pipeline fills at the start of a run:
    the first step generates its own batch and the next ``lag`` ones on the same
    weights, so step ``k`` lags ``min(k, lag)`` versions. A checkpoint saves the batches waiting
    (``pending_batches``), so a resumed run goes on as the uninterrupted one."""

    name = "lagged"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: deque[concurrent.futures.Future] = deque()  # steps k + 1 ... k + lag, in order

    @property
    def depth(self) -> int:
        return self.cfg.rollout.lagged.lag

    def _groups(self, step: int):
        if self._pending and isinstance(self._pending[0].exception(), BatchAwaitsServers):
            # generated ahead while no server served: that batch and those after it start again now
            self._discard_pending(self._pending[0].exception().start_gid)
        out = self._pending.popleft().result() if self._pending else self._generate(step)
        # batches are drawn in step order on one thread: the groups of step j are always the same
        ahead = min(step + self.depth, self.cfg.schedule.total_steps - 1)
        for target in range(step + 1 + len(self._pending), ahead + 1):
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-rollout")
            self._pending.append(self._executor.submit(self._generate, target))
        return out

    def _discard_pending(self, start_gid: int) -> None:
        """Drop every batch generated ahead (waiting for those running: they draw groups) and
        draw again from group ``start_gid``."""
        for f in self._pending:
            f.cancel()
        concurrent.futures.wait(list(self._pending))
        self._pending.clear()
        self.next_gid = start_gid
        log.warning("the batches generated ahead found no rollout server serving: generated again from group %d",
                    start_gid)

    def before_sync(self) -> dict[str, float]:
        if not self._pending:
            return {}
        t0 = time.perf_counter()  # the batches queued this step are made on these weights: they must finish first
        concurrent.futures.wait(list(self._pending))
        return {"time/trainer_idle_next_batch": time.perf_counter() - t0}

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._pending.clear()

    def checkpoint_files(self) -> dict[str, bytes]:
        """The batches generated ahead (all finished: ``before_sync`` waited for them before the
        checkpoint), so that a resumed run trains on them as the uninterrupted one would."""
        if not self._pending:
            return {}
        # a failed batch (the next step raises it) or a field JSON cannot hold: this checkpoint goes
        # without them and a resume regenerates them on its own weights
        why = next((f"one failed: {f.exception()}" for f in self._pending if f.exception() is not None), None)
        if why is None:
            try:
                return pending_batches.encode([f.result() for f in self._pending], self.next_gid)
            except TypeError as err:
                why = str(err)
        log.warning("the checkpoint leaves out the batches generated ahead (%s); a resume regenerates them "
                    "on its own weights", why)
        return {}

    def restore_files(self, ckpt_dir: Path) -> None:
        batches, next_gid = pending_batches.decode(ckpt_dir)
        for batch in batches:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(batch)
            self._pending.append(done)
        if batches:
            self.next_gid = next_gid


class OneStepOffSource(LaggedSource):
    """``lagged`` with a lag of exactly one version: step ``k + 1``'s batch is generated while
    step ``k`` trains, on step ``k``'s weights. The first step of a run (or of a resume)
    generates its own."""

    name = "one_step_off"

    @property
    def depth(self) -> int:
        return 1


class AsyncSource(RolloutSource):
    """A producer keeps the servers generating across weight updates; a step takes the groups
    that finished, at most ``rollout.staleness.max`` versions behind."""

    name = "async"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._producer: Optional[AsyncProducer] = None
        self._partial: Optional[dict] = None  # the collect of a step that no server could finish yet

    @classmethod
    def pauses(cls, rollout: RolloutConfig) -> bool:
        return rollout.async_.pause_mode != "off"

    def _groups(self, step: int):
        r = self.cfg.rollout
        if self._producer is None:
            self.conn.check_servers("the asynchronous rollouts")
            self._producer = AsyncProducer(self.open_groups, self.settled.unsettled_from(self.settled.frontier),
                                           window=(r.staleness.max + 1) * self.cfg.schedule.batch_size,
                                           rejoining=self.conn.fleet_rejoining).start()
        timeout = r.timeout_s * (r.max_turns + 1)
        # taken one at a time: a take that raises (no server serving; the trainer syncs and calls
        # again) leaves every group taken before it in the collect's state
        if self._partial is None:
            self._partial = {}
        out = self.collect(step, lambda k: (self._producer.take(timeout) for _ in range(k)), slots=self._producer,
                           state=self._partial)
        self._partial = None
        return out

    def after_sync(self, version: int) -> None:
        if self._producer is not None:  # this step's groups free their slots for the new weights
            self._producer.release()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None


SOURCES: dict[str, type[RolloutSource]] = {
    cls.name: cls for cls in (SyncSource, OneStepOffSource, LaggedSource, AsyncSource)
}


def source_class(cfg: TrainConfig) -> type[RolloutSource]:
    """The source of ``rollout.mode`` (the one place that reads it)."""
    mode = cfg.rollout.mode
    if mode not in SOURCES:
        raise RuntimeError(f"rollout.mode={mode} has no rollout source: ROLLOUT_MODES (trainer/recipe/"
                           f"rollout_modes.py) names it, SOURCES (trainer/sources/modes.py) has only {sorted(SOURCES)}")
    return SOURCES[mode]


def make_rollout_source(cfg: TrainConfig, *args, **kw) -> RolloutSource:
    """The run's source (rank 0 warns when a lagged mode has nothing correcting for the lag)."""
    cls = source_class(cfg)
    if kw.get("conn") is not None and ROLLOUT_MODES[cls.name].stale and cfg.algorithm.loss.is_correction.mode == "off":
        log.warning("rollout.mode=%s trains on tokens sampled by older weights; without "
                    "algorithm.loss.is_correction.mode (tis / mis) nothing corrects for it", cls.name)
    return cls(cfg, *args, **kw)
