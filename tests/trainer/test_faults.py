"""Every wait on the servers is bounded by the recipe (issue 15, class 5).

Real embedded servers on 127.0.0.1, started the way a run starts them (``EmbeddedServers``,
per-run API keys), then killed (SIGKILL) or hung (SIGSTOP: the socket still accepts
connections, nothing answers). Each test asserts a generous upper bound on the time to the
error (a few times the configured timeout plus slack for a loaded machine) and that the error
names the server, what failed and the phase. The trainer's own clients (``_rollout_client``,
``_retrieval_client``) and its health check (``check_servers``) are exercised; no engine is
built: the health check comes first in each phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web
from safetensors.torch import load_file

from sorl_megatron.common.background import BackgroundServer, free_port, wait_healthy
from sorl_megatron.common.http import ServerError, ServerTimeoutError, ServerUnavailableError
from sorl_megatron.common.protocol import SamplingParams
from sorl_megatron.data.tiny_model import TinyModelConfig, save_tiny_model
from sorl_megatron.data.tokenizer import train_tokenizer
from sorl_megatron.trainer.recipe.config import RecipeError
from sorl_megatron.trainer.recipe.loader import load_recipe
from sorl_megatron.trainer.rl_loop import RLTrainer
from sorl_megatron.trainer.serving.servers import EmbeddedServers, retrieval_server_spec, rollout_server_spec
from sorl_megatron.trainer.stages.drivers import PVPOStage
from sorl_megatron.weight_sync.tensor import send_tensors

from .e2e_helpers import BASE_RECIPE

SLACK_S = 6.0  # process scheduling on a loaded 2-core machine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    texts = ["<search> capital of France </search> <answer> Paris </answer>", "the city lies in the land"] * 20
    tok = train_tokenizer(texts, vocab_size=200)
    cfg = TinyModelConfig(arch="qwen2", num_layers=1, hidden_size=32, intermediate_size=64, seed=5)
    return save_tiny_model(cfg, tmp_path_factory.mktemp("fault_model"), tok)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fault_corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f'"Doc {i}"\ntown{i} lies in land{i}'}) + "\n"
                            for i in range(5)))
    return path


def trainer_for(model_dir: Path, *overrides: str, rollout_url: str = "", retrieval_url: str = "",
                api_keys: dict | None = None) -> RLTrainer:
    """A trainer with the recipe's overrides, wired to these servers as ``run()`` wires it."""
    cfg = load_recipe(BASE_RECIPE, [f"model.path={model_dir}", "data.train=unused.parquet",
                                    f"retrieval.url={retrieval_url or 'http://127.0.0.1:9'}", *overrides])
    trainer = RLTrainer(cfg)
    trainer.attach([None], [], None)  # one prompt: step() picks it before the health check
    trainer.conn.rollout_urls = [rollout_url] if rollout_url else []
    trainer.conn.retrieval_url = retrieval_url or None
    trainer.conn.api_keys = dict(api_keys or {})
    return trainer


@contextmanager
def server(tmp_path: Path, spec):
    """One embedded server; on exit a stopped one is continued, then all are stopped."""
    servers = EmbeddedServers(tmp_path)
    try:
        url = servers.start(spec)
        yield url, servers.procs[spec.name], servers.api_keys
    finally:
        for proc in servers.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        servers.stop()


def kill(proc) -> None:
    proc.kill()
    proc.wait(timeout=10)


def timed_raises(exc, match: str, fn) -> float:
    t0 = time.monotonic()
    with pytest.raises(exc, match=match):
        fn()
    return time.monotonic() - t0


# ------------------------------------------------------------------------------- rollout server


def test_rollout_server_hung_during_weight_sync(tmp_path, model_dir):
    """SIGSTOP between two buckets of a sync: the bucket times out after
    rollout.weight_sync.timeout_s (once: a timeout is not retried) and the closing
    /end_weight_update after rollout.health_timeout_s; before, the trainer waited 600 s."""
    sync_s, health_s = 2.0, 1.0
    with server(tmp_path, rollout_server_spec(str(model_dir), "fp32", False, 1)) as (url, proc, keys):
        trainer = trainer_for(model_dir, "rollout.timeout_s=20", f"rollout.weight_sync.timeout_s={sync_s}",
                              f"rollout.health_timeout_s={health_s}", rollout_url=url, api_keys=keys)
        trainer.check_servers("the weight sync to version step_1", retrieval=False)  # healthy: passes
        tensors = load_file(str(model_dir / "model.safetensors"))

        def stop_after_first():
            for i, item in enumerate(tensors.items()):
                if i == 1:
                    os.kill(proc.pid, signal.SIGSTOP)  # the first bucket is on its way
                yield item

        async def sync():
            client = trainer.conn.rollout_client()
            try:
                await send_tensors(client, stop_after_first(), "step_1", bucket_bytes=1)
            finally:
                await client.close()

        took = timed_raises(
            ServerTimeoutError,
            rf"/update_weights_from_tensor failed on 1/1 rollout server\(s\): {url}: .*did not answer within 2 s",
            lambda: asyncio.run(sync()),
        )
        assert took < 3 * sync_s + SLACK_S, took
        # the next phase's health check names the hung server, the phase and the timeout
        took = timed_raises(
            ServerTimeoutError,
            rf"rollout server {url} did not answer /health within 1 s before the weight sync to version step_2",
            lambda: trainer.sync_weights(2),
        )
        assert took < 3 * health_s + SLACK_S, took


def test_rollout_server_killed(tmp_path, model_dir):
    """Killed: generation fails after rollout.retries quick reconnects, and the health check
    before the next rollout phase names the server."""
    with server(tmp_path, rollout_server_spec(str(model_dir), "fp32", False, 1)) as (url, proc, keys):
        trainer = trainer_for(model_dir, "rollout.timeout_s=30", "rollout.retries=1", rollout_url=url, api_keys=keys)

        async def generate():
            client = trainer.conn.rollout_client()
            try:
                return await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
            finally:
                await client.close()

        assert len(asyncio.run(generate())) == 1  # alive: generation works with the run's key
        kill(proc)
        took = timed_raises(ServerUnavailableError, rf"no rollout server reachable: .*{url}.*after 2 attempts",
                            lambda: asyncio.run(generate()))
        assert took < SLACK_S, took
        took = timed_raises(ServerUnavailableError, rf"rollout server {url} is unreachable before the rollout phase "
                            r"of step 3 \(", lambda: trainer.step(2))
        assert took < SLACK_S, took


# ----------------------------------------------------------------------------- retrieval server


def test_retrieval_server_hung(tmp_path, model_dir, corpus):
    """SIGSTOP: one /retrieve fails after retrieval.timeout_s (not x 4 attempts of 60 s as
    before), and the health check before the rollout phase names the server."""
    timeout_s, health_s = 1.5, 1.0
    with server(tmp_path, retrieval_server_spec(str(corpus), 1)) as (url, proc, keys):
        trainer = trainer_for(model_dir, f"retrieval.timeout_s={timeout_s}", f"retrieval.health_timeout_s={health_s}",
                              retrieval_url=url, api_keys=keys)

        async def retrieve():
            client = trainer.conn.retrieval_client()
            try:
                return await client.retrieve(["town3"])
            finally:
                await client.close()

        assert asyncio.run(retrieve())[0][0].id == "3"
        os.kill(proc.pid, signal.SIGSTOP)
        took = timed_raises(ServerTimeoutError, rf"POST {url}/retrieve did not answer within 1.5 s",
                            lambda: asyncio.run(retrieve()))
        assert took < 3 * timeout_s + SLACK_S, took
        took = timed_raises(
            ServerTimeoutError,
            rf"retrieval server {url} did not answer /health within 1 s before the rollout phase of step 4",
            lambda: trainer.step(3),
        )
        assert took < 3 * health_s + SLACK_S, took


def test_retrieval_server_killed_is_noticed_before_every_phase(tmp_path, model_dir, corpus):
    """Killed: noticed by the health check before each phase that rolls out (rollout,
    validation, PVPO reference pass), before any episode runs, so also by a policy that never
    searches (before, a dead retrieval server went unnoticed for a whole run)."""
    with server(tmp_path, retrieval_server_spec(str(corpus), 1)) as (url, proc, keys):
        trainer = trainer_for(model_dir, "retrieval.retries=1", retrieval_url=url, api_keys=keys)
        trainer.val_rows = [object()]  # validation has rows to play
        trainer.check_servers("the rollout phase of step 1")  # alive: passes
        kill(proc)
        for phase, call in [
            ("the rollout phase of step 1", lambda: trainer.step(0)),
            ("validation", trainer.validate),
            ("the PVPO reference pass before step 1",
             PVPOStage(trainer.cfg, trainer.stream, trainer.rewards, trainer.conn).reference_pass),
        ]:
            took = timed_raises(ServerUnavailableError, rf"retrieval server {url} is unreachable before {phase} \(",
                                call)
            assert took < SLACK_S, (phase, took)


# ------------------------------------------------------------------------------- both at once


class HungHealth:
    """A server whose /health never answers (an in-process stand-in for the concurrency check)."""

    def __init__(self):
        async def health(_):
            await asyncio.sleep(3600)

        app = web.Application()
        app.router.add_get("/health", health)
        self.server = BackgroundServer(app, "127.0.0.1", 0).start()


def test_servers_are_checked_at_once_and_every_failure_is_named(model_dir):
    """Two hung servers cost one health timeout, not two, and the error names both."""
    hung = [HungHealth(), HungHealth()]
    try:
        rollout, retrieval = (h.server.url for h in hung)
        trainer = trainer_for(model_dir, "rollout.health_timeout_s=1.5", "retrieval.health_timeout_s=1.5",
                              rollout_url=rollout, retrieval_url=retrieval)
        took = timed_raises(
            ServerError,
            rf"rollout server {rollout} did not answer /health within 1.5 s before validation; "
            rf"retrieval server {retrieval} did not answer /health within 1.5 s before validation",
            lambda: trainer.check_servers("validation"),
        )
        assert took < 1.5 + SLACK_S, took
    finally:
        for h in hung:
            h.server.stop()


def test_start_up_wait_is_bounded_by_its_timeout_even_when_health_hangs():
    """wait_healthy's polls never outlast its timeout (a hung poll used to add up to 2 s)."""
    hung = HungHealth()
    try:
        took = timed_raises(TimeoutError, r"/health did not answer 200 within 1 s",
                            lambda: wait_healthy(hung.server.url, timeout_s=1.0, poll_timeout_s=30.0))
        assert took < 1.0 + SLACK_S, took
    finally:
        hung.server.stop()


# ---------------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize("key", ["rollout.timeout_s", "rollout.weight_sync.timeout_s", "rollout.health_timeout_s",
                                 "retrieval.timeout_s", "retrieval.health_timeout_s"])
@pytest.mark.parametrize("value,message", [("0", "must be > 0 seconds"), ("-1", "must be > 0 seconds"),
                                           (".inf", "must be a finite number"), (".nan", "must be a finite number")])
def test_timeouts_are_positive_and_finite(model_dir, key, value, message):
    with pytest.raises(RecipeError, match=rf"{key} {message}"):
        load_recipe(BASE_RECIPE, [f"model.path={model_dir}", "data.train=t.parquet", f"{key}={value}"])


@pytest.mark.parametrize("key", ["rollout.retries", "retrieval.retries"])
def test_retries_are_not_negative(model_dir, key):
    with pytest.raises(RecipeError, match=rf"{key} must be >= 0"):
        load_recipe(BASE_RECIPE, [f"model.path={model_dir}", "data.train=t.parquet", f"{key}=-1"])


def test_recipe_values_reach_every_client(model_dir):
    port = free_port()
    trainer = trainer_for(model_dir, "rollout.timeout_s=7", "rollout.weight_sync.timeout_s=8",
                          "rollout.health_timeout_s=9", "rollout.retries=4", "retrieval.timeout_s=3",
                          "retrieval.health_timeout_s=2", "retrieval.retries=0",
                          rollout_url=f"http://127.0.0.1:{port}", retrieval_url=f"http://127.0.0.1:{port}")
    c = trainer.conn.rollout_client().cfg
    assert (c.generate_retry.timeout_s, c.control_retry.timeout_s, c.health_retry.timeout_s) == (7, 8, 9)
    assert {c.generate_retry.retries, c.control_retry.retries, c.health_retry.retries} == {4}
    assert not (c.generate_retry.retry_on_timeout or c.control_retry.retry_on_timeout)
    r = trainer.conn.retrieval_client()
    assert (r.policy.timeout_s, r.health_policy.timeout_s, r.policy.retries, r.health_policy.retries) == (3, 2, 0, 0)
    assert not r.policy.retry_on_timeout  # a hung server fails after retrieval.timeout_s
