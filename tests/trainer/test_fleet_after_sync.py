"""Failover after a weight sync with the default transport (``rollout.weight_sync.transport=distributed``;
issue 31, item 1).

The sync after step 1 forms the trainer's weight-update group with both servers; then one
server is killed (SIGKILL) during step 2's rollout. The fleet restarts it on a new port; the
sync after step 2 must go to the fleet's current URLs (the sender leaves the group of the old
ones and forms one with the restarted server) and the restarted server must hold those weights
before it serves step 3. Before, the sender kept the first sync's URLs and the run ended at the
next sync. One test per way the trainer reaches the servers: client-side balancing (no
router), behind ``sglang-router``, and the async producer behind the router.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.rl_loop import RLTrainer

from .e2e_helpers import BASE_RECIPE, read_metrics, run_overrides
from .test_fleet import FLEET, Saboteur, tiny_data  # noqa: F401 (tiny_data: the fixture)

pytest.importorskip("sglang_router")

STEPS = ["schedule.total_steps=3"]


def _synced_once(trainer: RLTrainer) -> bool:
    """Step 1's row is logged: the sync after it has formed the group with both servers."""
    path = trainer.run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    return any(json.loads(x).get("step") == 1 for x in path.read_text().splitlines() if x.strip())


class GroupWatch:
    """Records the servers of the sender's group at the moment ``when`` first holds (the URLs
    the group was formed with before the kill)."""

    def __init__(self):
        self.urls: tuple[str, ...] | None = None

    def __call__(self, trainer: RLTrainer) -> bool:
        if not _synced_once(trainer):
            return False
        sender = getattr(trainer.weights.transport, "sender", None)
        if self.urls is None and sender is not None:
            self.urls = tuple(sender.group_urls)
        return True


class DirectKill(threading.Thread):
    """No router to say which server is busy: SIGKILL the second server once ``when`` holds
    (step 2's rollout is starting; its next call to that server fails)."""

    def __init__(self, trainer: RLTrainer, when, timeout_s: float = 600.0):
        super().__init__(daemon=True)
        self.trainer, self.when, self.timeout_s = trainer, when, timeout_s
        self.victim: tuple[str, int] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self.when(self.trainer):
                assert time.monotonic() < deadline, "the trainer never finished its first sync"
                time.sleep(0.02)
            fleet = self.trainer.conn.fleet
            worker = fleet.workers[1]
            pid = fleet.servers.procs[worker.name].pid
            os.kill(pid, signal.SIGKILL)
            self.victim = (worker.name, pid)
        except BaseException as err:  # surfaced by the test
            self.error = err


def _kill_after_sync(tiny_data: Path, tmp_path: Path, name: str, *extra: str, router: bool = True):  # noqa: F811
    overrides = [*run_overrides(tiny_data, tmp_path, name), *FLEET, *STEPS, *extra]
    if not router:
        overrides.append("rollout.fleet.router=none")
    trainer = RLTrainer(load_recipe(BASE_RECIPE, overrides))
    watch = GroupWatch()
    killer = Saboteur(trainer, signal.SIGKILL, timeout_s=600, when=lambda: watch(trainer)) if router \
        else DirectKill(trainer, watch)
    killer.start()
    try:
        trainer.run()
    finally:
        killer.join(timeout=5)
    assert killer.error is None, killer.error
    assert killer.victim is not None
    run_dir = tmp_path / name
    victim = killer.victim[0]
    # the kill came after a sync whose group held the victim's first URL
    old = watch.urls or ()
    assert len(old) == 2, f"no weight-update group with both servers before the kill: {watch.urls}"
    metrics = read_metrics(run_dir)
    steps = [metrics[s] for s in (1, 2, 3)]
    total = {k: sum(m[f"rollout/{k}"] for m in steps) for k in
             ("server_failures", "server_restarts", "servers_rejoined")}
    assert total == {"server_failures": 1, "server_restarts": 1, "servers_rejoined": 1}, total
    assert metrics[1]["rollout/server_failures"] == 0  # the kill was after the first sync
    assert steps[-1]["rollout/servers_up"] == 2
    assert all(m.get("rollout/finish_error", 0) == 0 for m in steps)
    # the restarted server (its log continues) joined the new group and took the sync before
    # its first /generate, and it served
    log = (run_dir / "servers" / f"{victim}.log").read_text(errors="replace")
    assert log.count("Running on http://127.0.0.1:") == 2, "the server was not started again"
    after = log.rsplit("Running on http://127.0.0.1:", 1)[1]
    first_generate = after.find("POST /generate")
    assert first_generate > 0, "the restarted server got no call"
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/end_weight_update"):
        at = after.find(f"POST {path}")
        assert 0 <= at < first_generate, f"{path} did not reach the restarted server before it served"
    new_port = after.split(maxsplit=1)[0]
    assert all(not u.endswith(f":{new_port}") for u in old), "the restart reused a port: nothing was tested"
    return run_dir, metrics


def _episodes(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines() if x.strip()]


def test_killed_after_a_sync_without_a_router(tiny_data, tmp_path):  # noqa: F811
    """Client-side balancing: every turn of step 3 ran on step 2's weights (a server left on its
    start-up weights would report version 0)."""
    run_dir, _ = _kill_after_sync(tiny_data, tmp_path, "norouter", router=False)
    step3 = [r for r in _episodes(run_dir) if r["step"] == 3 and r["status"] == "trained"]
    assert step3 and all(v == 2 for r in step3 for t in r["turn_versions"] for v in t), step3


def test_killed_after_a_sync_behind_the_router(tiny_data, tmp_path):  # noqa: F811
    run_dir, _ = _kill_after_sync(tiny_data, tmp_path, "router")
    step3 = [r for r in _episodes(run_dir) if r["step"] == 3 and r["status"] == "trained"]
    assert step3 and all(v == 2 for r in step3 for t in r["turn_versions"] for v in t), step3


def test_killed_after_a_sync_in_async_mode(tiny_data, tmp_path):  # noqa: F811
    """The async producer generates across syncs (turns may lag a version), so the proof is the
    restarted server's log above and that no turn ran on the start-up weights (version 0)
    after the kill."""
    run_dir, metrics = _kill_after_sync(tiny_data, tmp_path, "async", "rollout.mode=async",
                                        "algorithm.loss.is_correction.mode=tis")
    later = [r for r in _episodes(run_dir) if r["step"] == 3 and r["status"] == "trained"]
    assert later and all(v >= 1 for r in later for t in r["turn_versions"] for v in t), later
