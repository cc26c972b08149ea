"""Rollout groups, their bookkeeping and the asynchronous producer (``rollout.mode``).

A *group* is the ``rollout.group_size`` episodes of one prompt. Groups are numbered in the
order the data stream hands out prompts (group ``g`` is position ``g % batch_size`` of the
stream's batch ``g // batch_size``, with that position's seeds), so a sync run without
dynamic sampling draws exactly the groups, prompts and seeds it always did, and every mode
draws prompts in the same order.

Whatever the mode, a group is *settled* once a finished step has trained on it or dropped it
(stale, or all rewards equal under dynamic sampling). A checkpoint saves the settled set as a
frontier (every group below it settled) and the settled groups above it; a resumed run draws
every other group again, so the groups that were in flight or finished but not yet trained on
when a run was killed are regenerated, and none that a checkpointed step trained on is drawn
twice (docs/concepts/rollout.md, "Rollout modes").

:class:`AsyncProducer` (``rollout.mode=async``) keeps up to ``window`` groups in flight,
finished-but-not-taken or taken by the step in progress, on a background thread with its own
event loop; the trainer takes the finished ones between its steps while the servers go on
generating across weight updates, and a step's groups hold their slots until the weight sync
after it. Releasing a slot at the take instead would let the producer run a whole extra batch
ahead: with ``window = (K + 1) x batch`` every other batch would wait K + 1 versions and be
dropped as stale (docs/concepts/rollout.md, "Rollout modes", has the measurement).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from ...common import aio
from ...common.http import ServerError, ServerUnavailableError
from ...rollout.trajectory import Trajectory

log = logging.getLogger("sorl_megatron.trainer")


@dataclass
class Group:
    """One prompt's episodes, as generated (rewards and injection are the trainer's)."""

    gid: int
    prompt: int  # dataset index
    trajectories: list[Trajectory]
    rewards: Optional[torch.Tensor] = None  # [group_size] float32, once scored
    injected: Optional[torch.Tensor] = None  # [group_size] bool: PVPO ground truth
    finished_at: float = 0.0

    @property
    def oldest_version(self) -> Optional[int]:
        """The oldest weight version of any policy token of the group (None: no version known)."""
        found = [t.oldest_version for t in self.trajectories if not t.meta.get("ground_truth")]
        found = [v for v in found if v is not None]
        return min(found) if found else None


@dataclass
class SettledGroups:
    """Which groups finished steps trained on or dropped (a checkpoint's ``producer`` entry)."""

    frontier: int = 0  # every group below is settled
    above: set[int] = field(default_factory=set)  # settled groups >= frontier

    def add(self, gids: Iterable[int]) -> None:
        self.above.update(int(g) for g in gids)
        while self.frontier in self.above:
            self.above.discard(self.frontier)
            self.frontier += 1

    def settled(self, gid: int) -> bool:
        return gid < self.frontier or gid in self.above

    def unsettled_from(self, start: int) -> Iterable[int]:
        """Group ids from ``start`` up that are not settled, in order (endless)."""
        g = max(start, self.frontier)
        while True:
            if g not in self.above:
                yield g
            g += 1

    def to_json(self) -> dict[str, Any]:
        return {"frontier": self.frontier, "above": sorted(self.above)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SettledGroups":
        out = cls(int(data.get("frontier", 0)), set())
        out.add(int(g) for g in data.get("above", ()))
        return out


def version_lag_metrics(groups: Sequence[Group], version: int, max_staleness: int) -> dict[str, float]:
    """Per policy token: ``version - token version`` (mean, max and the fraction of tokens at
    each lag 0..max_staleness, ``over`` beyond it); ground-truth rows (no policy) are left out."""
    lags = [
        version - t.token_versions[np.asarray(t.loss_mask) != 0]
        for g in groups
        for t in g.trajectories
        if t.token_versions is not None and not t.meta.get("ground_truth")
    ]
    lag = np.concatenate(lags) if lags else np.zeros(0, np.int64)
    if lag.size == 0:
        return {}
    out = {"rollout/version_lag_mean": float(lag.mean()), "rollout/version_lag_max": float(lag.max())}
    for k in range(max_staleness + 1):
        out[f"rollout/version_lag_frac_{k}"] = float((lag == k).mean())
    out["rollout/version_lag_frac_over"] = float((lag > max_staleness).mean())
    out["rollout/partial_episodes"] = float(sum(
        _spans_versions(t.token_versions[np.asarray(t.loss_mask) != 0])
        for g in groups for t in g.trajectories if t.token_versions is not None
    ))
    return out


def equal_rewards(group: Group) -> bool:
    """DAPO's filter: every reward of the group is the same (GRPO gives it no signal)."""
    assert group.rewards is not None
    return bool(group.rewards.numel() > 0 and (group.rewards - group.rewards[0]).abs().max() <= 1e-6)


def apply_overlong(group: Group, mode: str, max_total_tokens: int, buffer: int, penalty: float) -> int:
    """DAPO's overlong handling on a scored group, in place; returns how many episodes it touched.

    ``filter``: an episode cut by the token budget (``finish_reason == "max_length"``) keeps its
    reward but gets a zero loss mask (it trains nothing). ``penalty``: the soft overlong
    punishment, on the episode's length (prompt, turns and observations: what the budget counts):
    0 up to ``max_total_tokens - buffer``, then falling linearly to ``-penalty`` at the budget;
    an episode the budget cut gets the full ``-penalty``."""
    assert group.rewards is not None
    if mode == "keep":
        return 0
    touched = 0
    for i, t in enumerate(group.trajectories):
        if t.meta.get("ground_truth"):
            continue
        cut = t.finish_reason == "max_length"
        if mode == "filter" and cut:
            group.trajectories[i] = dataclasses.replace(
                t, loss_mask=np.zeros_like(t.loss_mask), meta={**t.meta, "overlong_filtered": True})
            touched += 1
        elif mode == "penalty":
            over = len(t) - (max_total_tokens - buffer)
            if cut or over > 0:
                group.rewards[i] -= penalty if cut else penalty * min(over / buffer, 1.0)
                touched += 1
    return touched


class AsyncProducer:
    """Generates groups on a background thread, ``window`` at most in flight, waiting, or taken
    and not yet released.

    ``run_group(gid)`` is a coroutine factory made on the producer's own event loop by
    ``open_loop()`` (an async function returning ``(run_group, close)``), so its HTTP clients
    live on that loop. Group ids come from ``gids`` in order. The trainer calls :meth:`take`
    for the finished group with the lowest id (waiting while none is), :meth:`release` once a
    taken group no longer needs its slot (after the weight sync that follows its step, or when
    it is dropped), and :meth:`close` at the end; an error in the producer is raised by the
    next :meth:`take`.

    ``rejoining()`` (the fleet's: no server serves, a restarted one waits for a weight sync):
    a group that failed while it holds is not an error but is started again, from its first
    episode, once it no longer holds; meanwhile nothing new starts, and a :meth:`take` that
    finds nothing finished raises ``ServerUnavailableError`` at once, so that the trainer runs
    the weight sync that brings a server back (it would wait for nothing otherwise).
    """

    def __init__(
        self,
        open_loop: Callable[[], Awaitable[tuple[Callable[[int], Awaitable[Group]], Callable[[], Awaitable[None]]]]],
        gids: Iterable[int],
        window: int,
        rejoining: Optional[Callable[[], bool]] = None,
    ):
        self._open_loop = open_loop
        self._gids = iter(gids)
        self.window = window
        self._cv = threading.Condition()
        self._finished: dict[int, Group] = {}
        self._inflight: set[int] = set()
        self._held: set[int] = set()  # taken, slot not released yet
        self._stop = False
        self._error: Optional[BaseException] = None
        self._rejoining = rejoining
        self._retry: list[int] = []  # in flight, failed while no server served: started again later
        self.started = 0
        self._thread = threading.Thread(target=self._main, name="rollout-producer", daemon=True)

    def start(self) -> "AsyncProducer":
        self._thread.start()
        return self

    def _main(self) -> None:
        try:
            aio.run(self._loop())
        except BaseException as err:  # handed to the trainer by take()
            with self._cv:
                self._error = err
                self._cv.notify_all()

    async def _loop(self) -> None:
        run_group, close = await self._open_loop()
        tasks: dict[asyncio.Task, int] = {}
        try:
            while True:
                with self._cv:
                    if self._stop:
                        return
                    if self._retry:  # nothing new until no server is missing: then these first
                        new = [] if self._waiting() else sorted(self._retry)
                        self._retry = [] if new else self._retry
                    else:
                        room = self.window - len(self._inflight) - len(self._finished) - len(self._held)
                        new = [next(self._gids) for _ in range(max(room, 0))]
                        self._inflight.update(new)
                for gid in new:
                    tasks[asyncio.ensure_future(run_group(gid))] = gid
                    self.started += 1
                if not tasks:
                    await asyncio.sleep(0.05)
                    continue
                done, _ = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    gid = tasks.pop(task)
                    try:
                        group = task.result()  # an episode's error ends the producer (take raises it) ...
                    except ServerError:
                        if not self._waiting():
                            raise
                        with self._cv:  # ... unless no server served: then it starts again later
                            self._retry.append(gid)
                            self._cv.notify_all()
                        continue
                    group.finished_at = time.perf_counter()
                    with self._cv:
                        self._inflight.discard(gid)
                        self._finished[gid] = group
                        self._cv.notify_all()
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            await close()

    def _waiting(self) -> bool:
        return self._rejoining is not None and self._rejoining()

    def take(self, timeout_s: float) -> Group:
        """The finished group with the lowest id; waits at most ``timeout_s`` for one."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._finished:
                if self._error is not None:
                    raise self._error
                if self._retry and self._waiting():
                    raise ServerUnavailableError(
                        f"no rollout server serves: {len(self._retry)} rollout group(s) wait for a restarted "
                        "server to get the current weights (rollout.mode=async)")
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise TimeoutError(f"no rollout group finished within {timeout_s:.0f} s (rollout.mode=async)")
                self._cv.wait(min(left, 1.0))
            gid = min(self._finished)
            group = self._finished.pop(gid)
            self._held.add(gid)
            return group

    def release(self, gids: Optional[Iterable[int]] = None) -> None:
        """Free the slots of taken groups (``None``: all of them), so the producer starts new ones."""
        with self._cv:
            if gids is None:
                self._held.clear()
            else:
                self._held.difference_update(gids)
            self._cv.notify_all()

    def hold(self, gids: Iterable[int]) -> None:
        """Count released groups against the window again (dropped, then used to fill a batch
        after all); the producer starts nothing new until the window has room."""
        with self._cv:
            self._held.update(gids)

    def pending(self) -> tuple[int, int, int]:
        """(groups in flight, finished and not taken, taken and not released)."""
        with self._cv:
            return len(self._inflight), len(self._finished), len(self._held)

    def close(self, timeout_s: float = 60.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout_s)


def _spans_versions(versions: np.ndarray) -> bool:
    """Whether an episode's policy tokens came from more than one weight version."""
    return bool(versions.size) and bool(versions.min() != versions.max())
