"""The rollout fleet: two embedded servers behind the real ``sglang-router`` (issue 18).

Real processes on 127.0.0.1: the embedded rollout servers, the Rust router of the
``sglang-router`` package, the BM25 retrieval server. The training runs are in this process
(2 steps of the tiny recipe); a watcher thread kills (SIGKILL) or hangs (SIGSTOP) one
rollout server while the router counts a request in flight on it, so the failure is always
mid-rollout with a call to retry. The runs must complete, the server must be back (restarted,
synced, registered with the router) for the next step, and the metrics must say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from sorl_megatron.common.http import RetryPolicy, request
from sorl_megatron.common.protocol import bearer_headers
from sorl_megatron.rollout.router import RouterAdmin
from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.rl_loop import RLTrainer

from .e2e_helpers import BASE_RECIPE, ROOT, read_metrics, run_overrides, subprocess_env

pytest.importorskip("sglang_router")

FLEET = ["rollout.fleet.num_servers=2", "rollout.fleet.router=sglang_router", "rollout.fleet.router_policy=cache_aware",
         "schedule.total_steps=2", "rollout.fleet.start_timeout_s=240", "rollout.health_timeout_s=2",
         "rollout.fleet.router_balance_abs_threshold=1"]  # 4 episodes a step: spread them over both servers


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fleet_data")
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_synthetic_data.py"), "--out", str(out),
                    "--num-people", "8", "--make-model"],
                   check=True, capture_output=True, env=subprocess_env(), cwd=ROOT)
    return out


def _generate_calls(log: Path) -> int:
    return log.read_text(errors="replace").count("POST /generate") if log.exists() else 0


def test_router_config_errors_name_the_key(tiny_data):
    base = run_overrides(tiny_data, Path("/tmp"), "x")
    for extra, match in [
        (["rollout.fleet.router_url=http://127.0.0.1:1"],
         r"rollout.fleet.router_url is set but rollout.fleet.router=none"),
        (["rollout.fleet.router=sglang_router", "rollout.fleet.router_url=http://127.0.0.1:1"],
         r"rollout.fleet.router_url needs rollout.urls"),
        (["rollout.fleet.router=sglang_router", "rollout.fleet.router_url=ftp://x"],
         r"rollout.fleet.router_url: 'ftp://x'"),
        (["rollout.fleet.router=nginx"], r"rollout.fleet.router"),
        (["rollout.fleet.router_policy=fastest"], r"rollout.fleet.router_policy"),
        (["rollout.fleet.num_servers=0"], r"rollout.fleet.num_servers must be >= 1"),
        (["rollout.fleet.num_servers=2", "rollout.urls=[http://127.0.0.1:1]"],
         r"rollout.fleet.num_servers=2 starts embedded servers, but rollout.urls lists external ones"),
        (["rollout.fleet.failover_retries=-1"], r"rollout.fleet.failover_retries must be >= 0"),
        (["rollout.fleet.router_balance_abs_threshold=-1"], r"rollout.fleet.router_balance_abs_threshold must be >= 0"),
        (["rollout.fleet.start_timeout_s=0"], r"rollout.fleet.start_timeout_s must be > 0"),
        (["rollout.fleet.restart_command=./restart.sh"], r"rollout.fleet.restart_command is for external servers"),
        (["rollout.urls=[http://127.0.0.1:1]", "rollout.fleet.restart_command='a \"b'"],
         r"rollout.fleet.restart_command: .* is not a command line"),
    ]:
        with pytest.raises(RecipeError, match=match):
            load_recipe(BASE_RECIPE, [*base, *extra])


def test_router_keeps_an_episode_on_the_server_that_holds_its_prefix(tiny_data, tmp_path):
    """cache_aware through the real router: each server is told apart by its weight version;
    new prompts spread over both, and every later turn of an episode (its prompt plus what
    came since) goes where the first went."""
    from sorl_megatron.trainer.serving.fleet import start_fleet
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, rollout_server_spec

    cfg = load_recipe(BASE_RECIPE, [*run_overrides(tiny_data, tmp_path, "router"), *FLEET])
    with EmbeddedServers(tmp_path) as servers:
        fleet = start_fleet(cfg.rollout, tmp_path, servers, lambda name: rollout_server_spec(
            str(tiny_data / "model"), "fp32", False, 1, name=name, health_timeout_s=240))
        assert len(fleet.urls()) == 2 and fleet.router_url not in fleet.urls()
        key = servers.api_keys["rollout"]
        assert key not in " ".join(servers.procs["router"].args)  # the key reaches the router by variable

        async def go():
            policy = RetryPolicy(timeout_s=60)
            async with aiohttp.ClientSession(headers=bearer_headers(key)) as s:
                for i, url in enumerate(fleet.urls()):
                    await request(s, "POST", f"{url}/update_weight_version", {"new_version": f"server{i}"}, policy)
                generate = f"{fleet.router_url}/generate"

                async def turn(ids, seed):
                    out = await request(s, "POST", generate, {
                        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "sampling_seed": seed}}, policy)
                    return out["meta_info"]["weight_version"], ids + out["output_ids"] + [7, 8, 9]  # + an observation

                # first turns all at once, as a rollout sends them: the router balances them ...
                firsts = await asyncio.gather(*(turn([5 + e] + list(range(20, 80)), 0) for e in range(8)))
                # ... and sends every later turn where its episode's prefix is
                for episode, (server, ids) in enumerate(firsts):
                    for seed in (1, 2):
                        version, ids = await turn(ids, seed)
                        assert version == server, f"episode {episode} turn {seed + 1} moved from {server} to {version}"
                return [server for server, _ in firsts]

        seen = asyncio.run(go())
        assert set(seen) == {"server0", "server1"}, seen  # both servers took new episodes
        # the router without its key: refused (it guards its worker list too)
        async def anonymous():
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{fleet.router_url}/workers") as r:
                    return r.status

        assert asyncio.run(anonymous()) == 401


class Saboteur(threading.Thread):
    """Waits until the trainer's router counts a request in flight on one rollout server, then
    stops that server (SIGSTOP); if the router still counts it in flight a second later (the
    request is caught inside the stopped server), ``sig`` follows (SIGKILL: a crash; SIGSTOP: it stays
    hung), else it continues it and tries again."""

    def __init__(self, trainer: RLTrainer, sig: int, timeout_s: float = 300.0, when=None):
        super().__init__(daemon=True)
        self.trainer, self.sig, self.timeout_s = trainer, sig, timeout_s
        self.when = when  # strikes only once this holds (e.g. the background thread is generating)
        self.victim: tuple[str, int] | None = None  # (server name, pid)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as err:  # surfaced by the test
            self.error = err

    async def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        def fleet():
            conn = self.trainer.conn
            return conn.fleet if conn is not None else None

        while fleet() is None or fleet().router_url is None:
            assert time.monotonic() < deadline, "the trainer never started its fleet"
            await asyncio.sleep(0.05)
        fleet = fleet()
        admin = RouterAdmin(fleet.router_url, fleet.api_key)
        while time.monotonic() < deadline:
            if self.when is not None and not self.when():
                await asyncio.sleep(0.01)
                continue
            busy = [u for u, w in (await admin.workers()).items() if w.get("load", 0) > 0]
            for w in [w for w in fleet.workers if w.url in busy]:
                pid = fleet.servers.procs[w.name].pid
                os.kill(pid, signal.SIGSTOP)
                if await self._still_in_flight(admin, w.url):
                    if self.sig != signal.SIGSTOP:
                        os.kill(pid, self.sig)
                    self.victim = (w.name, pid)
                    return
                os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.01)
        raise AssertionError("no request was ever in flight on a rollout server")

    @staticmethod
    async def _still_in_flight(admin: RouterAdmin, url: str, settle_s: float = 1.0) -> bool:
        """Whether the stopped server holds a request: the router's count stays above 0 for
        ``settle_s``. A response that left the server just before the stop still reaches the
        router and brings the count to 0 (on a loaded machine that can take a while)."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            if (await admin.workers()).get(url, {}).get("load", 0) == 0:
                return False
            await asyncio.sleep(0.05)
        return True


def _run_with(tiny_data, tmp_path, name: str, sig: int, *extra: str, when=None):
    trainer = RLTrainer(load_recipe(BASE_RECIPE, [*run_overrides(tiny_data, tmp_path, name), *FLEET, *extra]))
    saboteur = Saboteur(trainer, sig, when=None if when is None else lambda: when(trainer))
    saboteur.start()
    try:
        trainer.run()
    finally:
        saboteur.join(timeout=5)
        if saboteur.victim and sig == signal.SIGSTOP:
            try:
                os.kill(saboteur.victim[1], signal.SIGCONT)  # (already killed by the restart)
            except ProcessLookupError:
                pass
    assert saboteur.error is None, saboteur.error
    assert saboteur.victim is not None
    return read_metrics(tmp_path / name), saboteur.victim[0]


def _assert_recovered(metrics: dict, run_dir: Path, victim: str) -> None:
    first, second = metrics[1], metrics[2]
    # step 1: one server failed mid-rollout, its call was sent again, it was restarted and is
    # back (synced, in the router) before step 2
    assert first["rollout/server_failures"] == 1 and first["rollout/server_restarts"] == 1, first
    assert first["rollout/retries"] >= 1, first
    assert first["rollout/servers_rejoined"] == 1 and first["rollout/servers_up"] == 2, first
    assert second["rollout/server_failures"] == 0 and second["rollout/servers_up"] == 2, second
    assert second["rollout/retries"] == 0, second
    # the restarted server (its log continues after the restart) served step 2
    log = (run_dir / "servers" / f"{victim}.log").read_text(errors="replace")
    assert log.count("Running on http://127.0.0.1:") == 2, "the server was not started again"
    assert "POST /generate" in log.rsplit("Running on http://127.0.0.1:", 1)[1], "the restarted server got no call"
    assert json.dumps(first)  # finite and serializable


def test_server_killed_mid_rollout(tiny_data, tmp_path):
    metrics, victim = _run_with(tiny_data, tmp_path, "killed", signal.SIGKILL)
    _assert_recovered(metrics, tmp_path / "killed", victim)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_server_killed_while_a_background_thread_generates(tiny_data, tmp_path, mode):
    """kill -9 of a rollout server while the one-step-off thread (step 2's batch, during step 1's
    training) or the async producer generates: the failure is handled from that thread (failover,
    one restart), the run finishes, the metrics count it, and every step trains a full batch of
    complete groups (no accepted episode lost, none drawn twice)."""
    busy = {"one_step_off": lambda t: bool(getattr(t.source, "_pending", None)),
            "async": lambda t: getattr(t.source, "_producer", None) is not None}[mode]
    metrics, victim = _run_with(tiny_data, tmp_path, mode, signal.SIGKILL, f"rollout.mode={mode}",
                                "algorithm.loss.is_correction.mode=tis", when=busy)
    steps = [metrics[s] for s in (1, 2)]
    total = {k: sum(m[f"rollout/{k}"] for m in steps) for k in
             ("server_failures", "server_restarts", "servers_rejoined", "retries")}
    assert total["server_failures"] == 1 and total["server_restarts"] == 1, total
    assert total["servers_rejoined"] == 1 and total["retries"] >= 1, total
    assert steps[-1]["rollout/servers_up"] == 2
    assert all(m.get("rollout/finish_error", 0) == 0 for m in steps)  # every call found a server
    log = (tmp_path / mode / "servers" / f"{victim}.log").read_text(errors="replace")
    assert log.count("Running on http://127.0.0.1:") == 2, "the server was not started again"
    rows = [json.loads(x) for x in (tmp_path / mode / "episodes.jsonl").read_text().splitlines() if x.strip()]
    for step in (1, 2):
        trained = [r for r in rows if r["step"] == step and r["status"] == "trained"]
        assert len(trained) == 2 and all(len(r["turn_versions"]) == 2 for r in trained), (step, trained)
    groups = [r["group"] for r in rows]
    assert len(groups) == len(set(groups))
    if mode == "one_step_off":
        assert sorted(groups) == list(range(len(groups)))  # none skipped


def test_server_hung_mid_rollout(tiny_data, tmp_path):
    """SIGSTOP: the call on the hung server fails after rollout.timeout_s (10 s: a loaded 2-core
    machine must still answer healthy calls within it), the health check
    after rollout.health_timeout_s; then as a crash."""
    t0 = time.monotonic()
    metrics, victim = _run_with(tiny_data, tmp_path, "hung", signal.SIGSTOP, "rollout.timeout_s=10")
    _assert_recovered(metrics, tmp_path / "hung", victim)
    assert metrics[1]["time/rollout"] >= 10  # the hung call waited out its timeout
    assert time.monotonic() - t0 < 600


def test_external_server_failure_runs_the_operators_hook(tmp_path):
    """External servers (no router): a dead one is taken out, rollout.fleet.restart_command runs
    with its URL, the others serve on; once it answers again it gets the next weight sync
    (prepare_sync lists it) and then serves (finish_sync). None left: a clear error."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer, free_port
    from sorl_megatron.common.http import ServerUnavailableError
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker

    async def health(request):
        return web.Response(text="ok")

    def app() -> web.Application:
        a = web.Application()
        a.router.add_get("/health", health)
        return a

    alive = BackgroundServer(app(), "127.0.0.1", 0).start()
    dead_port = free_port()
    dead = f"http://127.0.0.1:{dead_port}"
    marker = tmp_path / "restarted"
    fleet = RolloutFleet(timeout_s=10, health=RetryPolicy(timeout_s=2, retries=0), run_dir=tmp_path,
                         workers=[Worker(alive.url), Worker(dead)],
                         restart_command=f"{sys.executable} -c \"import os, pathlib; "
                                         f"pathlib.Path({str(marker)!r}).write_text(os.environ['SORL_FAILED_SERVER_URL'])\"")
    try:
        asyncio.run(fleet.check("before the rollout phase of step 1"))
        assert fleet.urls() == [alive.url]
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.read_text() == dead  # the hook was told which server
        # a failed call on the alive server that still answers /health: nothing is taken out
        assert asyncio.run(fleet.on_failure(alive.url, ServerUnavailableError("reset"))) == [alive.url]
        assert fleet.prepare_sync() == [alive.url]  # still dead: not synced
        back = BackgroundServer(app(), "127.0.0.1", dead_port).start()  # the operator brought it back
        assert fleet.prepare_sync() == [alive.url, dead]  # it gets the sync ...
        assert fleet.urls() == [alive.url]  # ... before it serves
        fleet.finish_sync()
        assert fleet.urls() == [alive.url, dead]
        assert fleet.metrics() == {"rollout/retries": 0.0, "rollout/server_failures": 1.0,
                                   "rollout/server_restarts": 1.0, "rollout/servers_rejoined": 1.0,
                                   "rollout/servers_up": 2.0}
        back.stop()
        alive.stop()
        with pytest.raises(ServerUnavailableError, match=r"rollout server .* is unreachable before the rollout phase"):
            asyncio.run(fleet.check("before the rollout phase of step 2"))
        assert f"({dead})" in (tmp_path / "servers" / "restart_hook.log").read_text()  # what ran, for whom
    finally:
        fleet.close()
        alive.stop()


def test_two_threads_reporting_one_dead_server_restart_it_once(tmp_path):
    """Async mode: the producer thread and the main thread (each its own event loop) report the
    same failed embedded server at once. One health check (never two at once), one restart, one
    failure counted, both told the same serving list; a late report of the old URL checks
    nothing. The server hangs on /health (1 s timeout), so both reports arrive during the check
    (with the old lock per event loop both checked it, and each could restart it)."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer
    from sorl_megatron.common.http import ServerTimeoutError
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, ServerSpec

    async def hang(request):
        await asyncio.sleep(3600)

    async def health(request):
        return web.Response(text="ok")

    hung_app, good_app = web.Application(), web.Application()
    hung_app.router.add_get("/health", hang)
    good_app.router.add_get("/health", health)
    hung = BackgroundServer(hung_app, "127.0.0.1", 0).start()
    good = BackgroundServer(good_app, "127.0.0.1", 0).start()
    with EmbeddedServers(tmp_path) as servers:
        # the restart launches this (a process that exits at once: only the count matters here)
        servers.launch(ServerSpec(name="rollout-0", module="sorl_megatron.rollout.router", args=["--no-such-flag"]))
        fleet = RolloutFleet(timeout_s=30, health=RetryPolicy(timeout_s=1, retries=0), run_dir=tmp_path,
                             workers=[Worker(hung.url, name="rollout-0"), Worker(good.url, name="rollout-1")],
                             servers=servers)
        barrier, answers, inside, checks = threading.Barrier(2), [], [0, 0], []
        health = fleet._health

        async def watched_health(urls, when):  # how many checks overlap, and of what
            inside[0] += 1
            inside[1] = max(inside)
            checks.append(list(urls))
            try:
                return await health(urls, when)
            finally:
                inside[0] -= 1

        fleet._health = watched_health

        def report():
            barrier.wait()
            answers.append(asyncio.run(fleet.on_failure(hung.url, ServerTimeoutError("generate timed out"))))

        threads = [threading.Thread(target=report) for _ in range(2)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert checks == [[hung.url]] and inside[1] == 1  # one check, never two at once
            assert servers.restarts == {"rollout-0": 1}
            assert fleet.counts == {"server_failures": 1, "server_restarts": 1}
            assert answers == [[good.url], [good.url]] and fleet.workers[0].url != hung.url
            # a late report of the old URL: nothing to check, nothing restarted
            assert asyncio.run(fleet.on_failure(hung.url, ServerTimeoutError("late"))) == [good.url]
            assert checks == [[hung.url]] and servers.restarts == {"rollout-0": 1}
        finally:
            hung.stop()
            good.stop()


class StubRouter:
    """sglang-router's worker API (``GET``/``POST /workers``, ``DELETE /workers/{id}``) over a
    dict, a worker's health read from its own ``/health`` as the router's checks would (the
    real router's API is exercised by the tests above), and one worker whose ``/health`` answers
    500 once ``alive`` is False. ``on_add(url)`` runs while the router is asked to add a worker."""

    def __init__(self, on_add=None):
        from aiohttp import web

        from sorl_megatron.common.background import BackgroundServer

        self.alive, self.listed, self.on_add = True, {}, on_add

        async def health(request):
            return web.Response(text="ok", status=200 if self.alive else 500)

        async def workers(request):
            out = []
            for url, record in self.listed.items():
                async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
                    out.append({**record, "is_healthy": r.status == 200})
            return web.json_response({"workers": out})

        async def add(request):
            url = (await request.json())["url"].rstrip("/")
            if self.on_add is not None:
                await asyncio.to_thread(self.on_add, url)
            self.listed[url] = {"url": url, "id": f"w{len(self.listed)}"}
            return web.json_response({"status": "queued"}, status=202)

        async def remove(request):
            for url, record in list(self.listed.items()):
                if record["id"] == request.match_info["id"]:
                    del self.listed[url]
            return web.json_response({"status": "queued"}, status=202)

        worker_app, router_app = web.Application(), web.Application()
        worker_app.router.add_get("/health", health)
        router_app.router.add_get("/workers", workers)
        router_app.router.add_post("/workers", add)
        router_app.router.add_delete("/workers/{id}", remove)
        self.worker = BackgroundServer(worker_app, "127.0.0.1", 0).start()
        self.router = BackgroundServer(router_app, "127.0.0.1", 0).start()

    def stop(self):
        self.worker.stop()
        self.router.stop()


def test_a_server_failing_while_it_is_registered_is_taken_back_out_of_the_router(tmp_path):
    """After a weight sync the joining servers are registered with the router. If one fails
    while that runs (the async producer's calls), its failure is handled before the router
    lists it, so taking it out finds nothing: the registration must take it back out, and not
    wait for the router to call it healthy. The failure is the fleet's own ``on_failure``, from
    another thread, while the router is being asked to add the server."""
    from sorl_megatron.common.http import ServerTimeoutError
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker

    def dies_and_is_reported(url):
        stub.alive = False
        asyncio.run(fleet.on_failure(url, ServerTimeoutError("generate")))

    stub = StubRouter(on_add=dies_and_is_reported)
    try:
        fleet = RolloutFleet(timeout_s=600, health=RetryPolicy(timeout_s=5, retries=0), run_dir=tmp_path,
                             workers=[Worker(stub.worker.url, state="joining")], router_url=stub.router.url)
        fleet.finish_sync()  # returns at once: nothing left to wait for (the bound is 600 s)
        assert fleet.workers[0].state == "down" and fleet.counts == {"server_failures": 1}
        assert stub.listed == {}  # not left in the router
    finally:
        stub.stop()


def test_a_server_that_failed_and_came_back_during_its_registration_waits_for_the_next_sync(tmp_path):
    """An external server fails while it is registered and its operator's hook brings it back
    on the same URL (with its initial weights) before the registration ends; a health check
    makes it *joining* again. Same URL, same state as before: only its count of failures tells
    that it missed this sync. It must not serve now: it stays joining (the next sync brings it
    back) and out of the router."""
    from sorl_megatron.common.http import ServerTimeoutError
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker

    def fails_and_comes_back(url):
        stub.alive = False
        asyncio.run(fleet.on_failure(url, ServerTimeoutError("generate")))
        stub.alive = True
        asyncio.run(fleet.check("before validation"))

    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer

    async def health(request):
        return web.Response(text="ok")

    serving_app = web.Application()
    serving_app.router.add_get("/health", health)
    serving = BackgroundServer(serving_app, "127.0.0.1", 0).start()  # the fleet's other server, serving
    stub = StubRouter(on_add=fails_and_comes_back)
    try:
        fleet = RolloutFleet(timeout_s=600, health=RetryPolicy(timeout_s=5, retries=0), run_dir=tmp_path,
                             workers=[Worker(stub.worker.url, state="joining"), Worker(serving.url)],
                             router_url=stub.router.url)
        fleet.finish_sync()
        assert [w.state for w in fleet.workers] == ["joining", "up"]
        assert fleet.counts == {"server_failures": 1} and stub.listed == {}
    finally:
        stub.stop()
        serving.stop()


def test_a_joining_server_the_router_never_calls_healthy_fails_instead_of_the_sync(tmp_path):
    """A joining server that dies after the sync, with nobody's call to report it: the router
    never lists it healthy. Past ``rollout.fleet.start_timeout_s`` the fleet takes it out as failed
    (the run goes on; it was a ServerError that ended the weight sync)."""
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker

    stub = StubRouter()
    stub.alive = False
    try:
        fleet = RolloutFleet(timeout_s=1, health=RetryPolicy(timeout_s=5, retries=0), run_dir=tmp_path,
                             workers=[Worker(stub.worker.url, state="joining")], router_url=stub.router.url)
        fleet.finish_sync()
        assert fleet.workers[0].state == "down" and fleet.counts == {"server_failures": 1}
        assert stub.listed == {}
    finally:
        stub.stop()


def test_a_long_lived_client_follows_a_restart_to_its_new_port(tmp_path):
    """The async producer's client lives for the whole run. Its calls go where the fleet says
    servers serve now: after a server is killed, restarted on a new port, synced and back, the
    same client's calls reach the new port (with its start-up URLs it never did)."""
    from sorl_megatron.common.protocol import SamplingParams
    from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, ServerSpec

    with EmbeddedServers(tmp_path) as servers:
        workers = [Worker(servers.launch(ServerSpec(name=f"rollout-{i}", module="tests.trainer.stub_rollout_server",
                                                    args=[], health_timeout_s=60)), name=f"rollout-{i}")
                   for i in range(2)]
        for w in workers:
            servers.wait_ready(w.name)
        fleet = RolloutFleet(timeout_s=60, health=RetryPolicy(timeout_s=2, retries=0), run_dir=tmp_path,
                             workers=workers, servers=servers)
        first = list(fleet.urls())
        client = RolloutClient(RolloutClientConfig(urls=tuple(first), routing="round_robin", failover_retries=1,
                                                   generate_retry=RetryPolicy(timeout_s=10, retries=0)),
                               on_failure=fleet.on_failure, serving=fleet.urls)

        async def ports(n):
            return [(await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))[0].weight_version
                    for _ in range(n)]

        async def go():
            try:
                before = await ports(2)
                servers.kill("rollout-1")  # a crash: its next call fails over, the fleet restarts it
                during = await ports(2)
                await asyncio.to_thread(fleet.prepare_sync)  # the restart is ready and gets the sync ...
                await asyncio.to_thread(fleet.finish_sync)  # ... then serves
                return before, during, await ports(4)
            finally:
                await client.close()

        before, during, after = asyncio.run(go())
        new = fleet.workers[1].url
        port = lambda url: url.rsplit(":", 1)[1]  # noqa: E731
        assert new not in first and fleet.urls() == [first[0], new]
        assert sorted(before) == sorted(map(port, first)) and set(during) == {port(first[0])}
        assert set(after) == {port(first[0]), port(new)}  # the same client now calls the new port
        assert client.retries == 1 and servers.restarts == {"rollout-1": 1}


def test_client_moves_a_call_off_a_hung_server_without_a_router(tmp_path):
    """No router (the client balances over the workers): a call on a server that hangs
    (accepts, never answers) times out, the fleet finds it does not answer /health either and
    takes it out, and the call is answered by the other server; counted once."""
    from aiohttp import web

    from sorl_megatron.common.background import BackgroundServer
    from sorl_megatron.common.protocol import SamplingParams
    from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
    from sorl_megatron.trainer.serving.fleet import RolloutFleet, Worker

    async def hang(request):
        await asyncio.sleep(3600)

    async def health(request):
        return web.Response(text="ok")

    async def generate(request):
        return web.json_response({"output_ids": [4, 5], "meta_info": {
            "id": "a", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
            "cached_tokens": 0, "weight_version": "good", "output_token_logprobs": [[-1.0, 4, None], [-2.0, 5, None]]}})

    hung_app, good_app = web.Application(), web.Application()
    hung_app.router.add_get("/health", hang)
    hung_app.router.add_post("/generate", hang)
    good_app.router.add_get("/health", health)
    good_app.router.add_post("/generate", generate)
    hung = BackgroundServer(hung_app, "127.0.0.1", 0).start()
    good = BackgroundServer(good_app, "127.0.0.1", 0).start()
    fleet = RolloutFleet(timeout_s=10, health=RetryPolicy(timeout_s=1, retries=0), run_dir=tmp_path,
                         workers=[Worker(hung.url), Worker(good.url)])
    cfg = RolloutClientConfig(urls=(hung.url, good.url), routing="round_robin", failover_retries=1,
                              generate_retry=RetryPolicy(timeout_s=1.5, retries=0))

    async def go():
        async with RolloutClient(cfg, on_failure=fleet.on_failure) as client:
            outs = [await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2)) for _ in range(2)]
            return outs, client.retries

    try:
        t0 = time.monotonic()
        outs, retries = asyncio.run(go())
        took = time.monotonic() - t0
    finally:
        hung.stop()
        good.stop()
    assert [o[0].weight_version for o in outs] == ["good", "good"] and retries == 1
    assert fleet.urls() == [good.url] and fleet.counts["server_failures"] == 1
    assert took < 1.5 + 1 + 6  # one generate timeout, one health timeout, slack: the second call never waits


def test_server_killed_during_a_weight_sync(tiny_data, tmp_path):
    """SIGKILL between two buckets of a tensor sync: the sync completes on the other server
    (before, it ended the run); the dead one is restarted and gets the next sync before it
    serves again."""
    from safetensors.torch import load_file

    from sorl_megatron.rollout.client import RolloutClient, RolloutClientConfig
    from sorl_megatron.trainer.serving.fleet import start_fleet
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, rollout_server_spec
    from sorl_megatron.weight_sync.tensor import send_tensors

    cfg = load_recipe(BASE_RECIPE, [*run_overrides(tiny_data, tmp_path, "sync"), "rollout.fleet.num_servers=2",
                                    "rollout.fleet.start_timeout_s=240", "rollout.health_timeout_s=2"])
    tensors = load_file(str(tiny_data / "model" / "model.safetensors"))
    with EmbeddedServers(tmp_path) as servers:
        fleet = start_fleet(cfg.rollout, tmp_path, servers, lambda name: rollout_server_spec(
            str(tiny_data / "model"), "fp32", False, 1, name=name, health_timeout_s=240))
        survivor, victim = fleet.urls()
        key = servers.api_keys["rollout"]

        def client(urls):
            return RolloutClient(RolloutClientConfig(urls=tuple(urls), api_key=key,
                                                     control_retry=RetryPolicy(timeout_s=60, retries=1),
                                                     health_retry=RetryPolicy(timeout_s=2, retries=0)),
                                 on_failure=fleet.on_failure)

        def killing_after_first():
            for i, item in enumerate(tensors.items()):
                if i == 1:
                    servers.kill("rollout-1")  # the first bucket reached both
                yield item

        async def sync(urls, items, version):
            async with client(urls) as c:
                await send_tensors(c, items, version, bucket_bytes=1)

        async def versions(urls):
            async with client(urls) as c:
                return [(await c.model_info(u))["weight_version"] for u in urls]

        asyncio.run(sync([survivor, victim], killing_after_first(), "step_1"))
        assert fleet.urls() == [survivor] and asyncio.run(versions([survivor])) == ["step_1"]
        assert fleet.counts == {"server_failures": 1, "server_restarts": 1}
        restarted = fleet.workers[1].url
        assert restarted != victim  # a new process on a new port, not serving yet
        targets = fleet.prepare_sync()  # waits for the restart
        assert targets == [survivor, restarted] and fleet.urls() == [survivor]
        asyncio.run(sync(targets, iter(tensors.items()), "step_2"))
        fleet.finish_sync()
        assert fleet.urls() == [survivor, restarted]
        assert asyncio.run(versions(fleet.urls())) == ["step_2", "step_2"]
        assert fleet.metrics()["rollout/servers_rejoined"] == 1


def test_external_router_takes_generation_and_the_workers_take_the_sync(tiny_data, tmp_path, monkeypatch):
    """Servers and router the trainer did not start (as on a cluster): rollout.urls are the
    workers, rollout.fleet.router_url the router in front of them. Every /generate of the run comes
    through the router (no User-Agent: the router's, not the trainer's aiohttp client), every
    weight update goes straight to each worker, and both serve the step's weights after it."""
    from sorl_megatron.trainer.serving.servers import EmbeddedServers, rollout_server_spec, router_spec

    with EmbeddedServers(tmp_path / "cluster") as servers:
        workers = [servers.start(rollout_server_spec(str(tiny_data / "model"), "fp32", False, 1, name=f"w{i}",
                                                     health_timeout_s=240)) for i in range(2)]
        router = servers.start(router_spec(workers, "cache_aware", 60, health_timeout_s=240,
                                           balance_abs_threshold=1))
        monkeypatch.setenv("SORL_ROLLOUT_API_KEY", servers.api_keys["rollout"])  # as a user hands it over
        overrides = [*run_overrides(tiny_data, tmp_path, "external"), f"rollout.urls=[{','.join(workers)}]",
                     "rollout.fleet.router=sglang_router", f"rollout.fleet.router_url={router}",
                     "schedule.total_steps=1"]
        RLTrainer(load_recipe(BASE_RECIPE, overrides)).run()
        metrics = read_metrics(tmp_path / "external")
        assert metrics[1]["rollout/servers_up"] == 2 and metrics[1]["rollout/server_failures"] == 0

        def requests(name: str, path: str) -> list[str]:
            log = (tmp_path / "cluster" / "servers" / f"{name}.log").read_text(errors="replace")
            return [line for line in log.splitlines() if f'"POST {path} HTTP' in line]

        generated = 0
        for name in ("w0", "w1"):
            gen = requests(name, "/generate")
            assert all(line.endswith('"-" "-"') for line in gen), (name, gen[:3])  # only the router's
            generated += len(gen)
            sync = requests(name, "/update_weights_from_distributed")
            assert sync and all("aiohttp" in line for line in sync), name  # the trainer, to each worker
        assert generated > 0

        async def versions():
            async with aiohttp.ClientSession(headers=bearer_headers(servers.api_keys["rollout"])) as s:
                return [(await request(s, "GET", f"{w}/get_model_info", None, RetryPolicy(timeout_s=10, retries=0)))
                        ["weight_version"] for w in workers]

        assert asyncio.run(versions()) == ["step_1", "step_1"]
