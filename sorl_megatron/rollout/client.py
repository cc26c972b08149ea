"""Async client for SGLang's native HTTP API (real SGLang servers or the embedded one).

Generation requests are spread over several servers (round robin or least-loaded) under
one concurrency bound, or all sent to one ``sglang-router`` (``router_url``) that routes them;
a server that refuses connections is skipped for a cool-down while the others carry on, and
when every server is down the error lists them all. With ``failover_retries``, a call that
times out or fails with 5xx is sent again (at most that many times) after the ``on_failure``
hook has had its say (the trainer's fleet health-checks the servers, takes a dead or hung one
out and restarts it). Control calls (weight updates, cache flush) go to every server, never
through the router. Which server takes a call, and what happens when one fails it, is
``failover.py``'s.

Which servers take generation can change while a client lives (the async producer's client
lives for the whole run): with ``serving`` (the trainer passes its fleet's ``urls``) each call
picks among the servers serving *now*, so a server restarted on a new port gets calls once it
is back. With ``pauses`` (a :class:`PauseClock`; the trainer passes one in async mode, the
only mode that pauses servers), the time the servers spend paused for a weight sync does not
count against a ``/generate`` call's timeout (up to the clock's cap); the timeout then bounds
the call with its HTTP re-sends, not each attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import aiohttp

from ..common.clock import ActiveClock
from ..common.http import (
    RequestRejectedError,
    RetryPolicy,
    ServerError,
    ServerTimeoutError,
    check_health,
    request,
)
from ..common.protocol import (
    ROLLOUT_API_KEY_ENV,
    GenerateOutput,
    ProtocolError,
    SamplingParams,
    bearer_headers,
    parse_generate_output,
)
from .failover import ControlSet, FailureHook, GenerationServers
from .server_facts import ServerFacts, ServerMismatchError, check_tensor_sync, same_protocol

log = logging.getLogger("sorl_megatron.rollout.client")


@dataclass(frozen=True)
class RolloutClientConfig:
    """Where and how to send rollout requests.

    Attributes:
        urls: base URLs of the servers (``http://host:port``).
        max_concurrency: most ``/generate`` calls in flight over all servers.
        routing: ``least_loaded`` (fewest in-flight calls, ties round robin) or ``round_robin``.
        generate_retry: policy of each ``/generate`` call (generous timeout, no retry on timeout).
        control_retry: policy of each weight-sync / cache / model-info call (one bucket of a
            tensor sync is one call).
        health_retry: policy of ``/health`` checks, and of the ``/end_weight_update`` that
            closes a sync that failed (short: a hung server must not double the wait).
        down_cooldown_s: how long a server that refused connections is skipped.
        routing_shape: ``(num_hidden_layers, top_k)`` to decode ``routed_experts``, from the
            model's HF config (``bridge.families.routing_shape``); required to ask for them.
        api_key: sent as ``Authorization: Bearer <key>`` to servers started with ``--api-key``
            (SGLang or the embedded server); None uses ``$SORL_ROLLOUT_API_KEY`` if set, else
            sends no header.
        router_url: an ``sglang-router`` in front of ``urls``: every ``/generate`` goes there;
            control calls and health checks still go to each of ``urls``.
        failover_retries: how many times one ``/generate`` call is sent again after it timed
            out or failed with 5xx (each counted in ``RolloutClient.retries``); 0: raise at once.
    """

    urls: tuple[str, ...]
    max_concurrency: int = 64
    routing: Literal["least_loaded", "round_robin"] = "least_loaded"
    generate_retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(timeout_s=600.0, retries=2))
    control_retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(timeout_s=600.0, retries=2))
    health_retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(timeout_s=10.0, retries=2))
    down_cooldown_s: float = 10.0
    routing_shape: tuple[int, int] | None = None
    api_key: str | None = field(default=None, repr=False)
    router_url: str | None = None
    failover_retries: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.urls, str):
            object.__setattr__(self, "urls", (self.urls,))
        if not self.urls:
            raise ValueError("rollout.urls: at least one server URL is required")
        object.__setattr__(self, "urls", tuple(u.rstrip("/") for u in self.urls))
        if self.max_concurrency < 1:
            raise ValueError(f"rollout.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.routing not in ("least_loaded", "round_robin"):
            raise ValueError(f"rollout.routing: {self.routing!r} is not one of least_loaded, round_robin")
        if self.router_url is not None:
            object.__setattr__(self, "router_url", self.router_url.rstrip("/"))
        if self.failover_retries < 0:
            raise ValueError(f"rollout.fleet.failover_retries must be >= 0, got {self.failover_retries}")


class PauseClock(ActiveClock):
    """How long the rollout servers have been paused for weight syncs (thread-safe): the
    trainer calls :meth:`pause` before ``/pause_generation`` and :meth:`resume` after
    ``/continue_generation``; a client holding the clock adds the paused seconds that overlap
    a ``/generate`` call to its timeout, at most ``max_credit_s`` per call (the recipe's
    ``rollout.weight_sync.timeout_s``), so a paused turn waits out a slow sync but never unboundedly."""

    def __init__(self, max_credit_s: float):
        if not max_credit_s >= 0:
            raise ValueError(f"rollout.weight_sync.timeout_s must be >= 0, got {max_credit_s}")
        super().__init__()
        self.max_credit_s = float(max_credit_s)

    def pause(self) -> None:
        self.enter(exclusive=True)

    def resume(self) -> None:
        self.exit()

    @property
    def paused(self) -> bool:
        return self.active

    async def bounded(self, send: Callable[[RetryPolicy], Awaitable[Any]], policy: RetryPolicy, what: str) -> Any:
        """``send(longest)``'s answer within ``policy.timeout_s`` plus the paused seconds that
        overlap the call, at most ``max_credit_s`` (``longest``: ``policy`` with the largest
        timeout, aiohttp's own bound); past that a :class:`ServerTimeoutError` naming ``what``."""
        t0 = time.monotonic()
        paused0 = self.seconds()
        longest = replace(policy, timeout_s=policy.timeout_s + self.max_credit_s)  # aiohttp's own bound
        call = asyncio.ensure_future(send(longest))
        try:
            while True:
                credit = min(self.seconds() - paused0, self.max_credit_s)
                left = t0 + policy.timeout_s + credit - time.monotonic()
                if left <= 0 and not (self.paused and credit < self.max_credit_s):
                    raise ServerTimeoutError(
                        f"{what} did not answer within {policy.timeout_s:g} s (rollout.timeout_s) "
                        f"plus {credit:.1f} s paused for weight syncs (at most {self.max_credit_s:g} s: "
                        f"rollout.weight_sync.timeout_s)")
                # credit only grows: unpaused, wake at the deadline and look again; paused, poll
                wait = max(left, 0.05)
                done, _ = await asyncio.wait({call}, timeout=min(wait, 1.0) if self.paused else wait)
                if done:
                    return call.result()
        finally:
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)


class RolloutClient:
    """``async with RolloutClient(cfg) as c: out = await c.generate(ids, SamplingParams(...))``."""

    def __init__(self, cfg: RolloutClientConfig | Sequence[str] | str, on_failure: FailureHook | None = None,
                 serving: Callable[[], Sequence[str]] | None = None, pauses: PauseClock | None = None,
                 on_retry: Callable[[], None] | None = None):
        """``serving()``: the URLs that take generation now (any thread may change them; None:
        ``cfg.urls`` less those ``on_failure`` dropped). ``pauses``: see :class:`PauseClock`.
        ``on_retry()``: told of each re-sent ``/generate`` call as it happens (any thread's
        client: the trainer counts them per step)."""
        if not isinstance(cfg, RolloutClientConfig):
            cfg = RolloutClientConfig(urls=(cfg,) if isinstance(cfg, str) else tuple(cfg))
        self.cfg = cfg
        self.pauses = pauses
        self.retries = 0  # /generate calls sent again after a server failed them (HTTP retries and failover)
        self.on_retry = on_retry
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._generation = GenerationServers(cfg.urls, cfg.routing, cfg.down_cooldown_s, cfg.router_url,
                                             cfg.failover_retries, serving, on_failure, self._count_retry)
        self._control = ControlSet(cfg.urls, on_failure)  # a server the fleet dropped mid-sync leaves
        self._routing_shape = cfg.routing_shape
        self._version_counter = 0
        self._pause_supported: bool | None = None  # /pause_generation: unknown until asked
        self._facts: dict[str, ServerFacts] | None = None  # /server_info of each server, asked once

    # ----- plumbing -----

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One pool for all servers; the semaphore, not the connector, bounds concurrency.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=bearer_headers(self.cfg.api_key, ROLLOUT_API_KEY_ENV)
            )
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        return self._session

    def session(self) -> aiohttp.ClientSession:
        """The client's HTTP session (its auth header), for protocol code that posts to each
        server itself (``weight_sync.distributed``)."""
        return self._sess()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def inflight(self) -> dict[str, int]:
        return self._generation.inflight

    # ----- generation -----

    async def routing_shape(self) -> tuple[int, int]:
        """``(layers, top_k)`` of the served model's routed experts: one row per decoder layer, as
        SGLang's capture buffer (dense layers unrouted). It comes from the model's own
        ``config.json`` (``RolloutClientConfig.routing_shape``, see ``bridge.families.routing_shape``):
        SGLang's ``/model_info`` does not report it."""
        if self._routing_shape is None:
            raise ProtocolError(
                "return_routed_experts needs RolloutClientConfig.routing_shape = (num_hidden_layers, "
                "num_experts_per_tok) from the served model's config.json (SGLang's /model_info has neither)")
        return self._routing_shape

    def build_request(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": sampling.to_json(),
            "return_logprob": return_logprob,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts_start_len
        if rid is not None:
            body["rid"] = rid
        return body

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> list[GenerateOutput]:
        """Sample ``sampling.n`` completions of one prompt; always a list of n outputs.

        Tokens in, tokens out: the prompt is sent as ids and the answer's ``output_ids`` are
        what the policy sampled (``no_stop_trim`` is forced so ids and log-probs line up).
        """
        if not sampling.no_stop_trim:
            sampling = SamplingParams(**{**sampling.__dict__, "no_stop_trim": True})
        shape = await self.routing_shape() if return_routed_experts else None
        body = self.build_request(
            input_ids, sampling, return_logprob, return_routed_experts, routed_experts_start_len, rid
        )
        data, url = await self._post_generate(body)
        objs = data if isinstance(data, list) else [data]
        if len(objs) != sampling.n:
            raise ProtocolError(f"{url}/generate returned {len(objs)} outputs for n={sampling.n}")
        outs = [parse_generate_output(o, shape, routed_experts_start_len, server=url) for o in objs]
        for o in outs:
            if return_logprob and o.output_logprobs is None:
                raise ProtocolError(f"{url}/generate answered without output_token_logprobs")
            if return_routed_experts and o.routed_experts is None:
                raise ProtocolError(
                    f"{url}/generate answered without routed_experts "
                    "(start the server with --enable-return-routed-experts)"
                )
        return outs

    async def _post_generate(self, body: dict[str, Any]) -> tuple[Any, str]:
        self._sess()
        assert self._sem is not None
        async with self._sem:
            return await self._generation.post(lambda url: self._generate_on(url, body))

    async def _generate_on(self, url: str, body: dict[str, Any]) -> Any:
        """One ``/generate`` call on ``url`` (or the router) under ``generate_retry``; with a
        :class:`PauseClock`, paused seconds overlapping the call extend its timeout (capped)."""

        def send(policy: RetryPolicy) -> Awaitable[Any]:
            # a re-send after a 5xx or a refused connection is a retry of the call too
            return request(self._sess(), "POST", f"{url}/generate", body, policy, on_retry=self._count_retry)

        if self.pauses is None:
            return await send(self.cfg.generate_retry)
        return await self.pauses.bounded(send, self.cfg.generate_retry, f"POST {url}/generate")

    def _count_retry(self) -> None:
        self.retries += 1
        if self.on_retry is not None:
            self.on_retry()

    # ----- control: every server -----

    async def _all(
        self, method: str, path: str, body: Any = None, expect_json: bool = True, policy: RetryPolicy | None = None
    ) -> dict[str, Any]:
        """``path`` on every server still in this client's control set; all must succeed
        (:meth:`.ControlSet.call`: a server the ``on_failure`` hook drops leaves the set)."""
        policy = policy or self.cfg.control_retry

        async def one(url: str):
            return await request(self._sess(), method, f"{url}{path}", body, policy, expect_json)

        return await self._control.call(one, path)

    def _next_version(self, weight_version: str | None) -> str:
        if weight_version is not None:
            return weight_version
        self._version_counter += 1
        return str(self._version_counter)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> str:
        """Every server reloads the HF checkpoint at ``model_path``; returns the new version."""
        version = self._next_version(weight_version)
        await self._all(
            "POST",
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": version, "flush_cache": flush_cache},
        )
        return version

    async def server_facts(self) -> dict[str, ServerFacts]:
        """``{url: ServerFacts}`` from every server's ``/server_info`` (asked once per client);
        :class:`ServerMismatchError` for a server this client cannot use (its version, flags)."""
        if self._facts is None:
            infos = await self._all("GET", "/server_info")
            facts = {u: ServerFacts.from_server_info(u, info) for u, info in infos.items()}
            same_protocol(facts)
            self._facts = facts
        return self._facts

    async def check_for_rollouts(self, tensor_sync: bool = False) -> None:
        """Refuse, naming it, a server the agent cannot use (:meth:`server_facts`, plus its flags:
        ``--skip-tokenizer-init`` refuses every request with stop strings), or one the tensor
        transport cannot update (``tensor_sync``: only the embedded server reads its bodies)."""
        facts = await self.server_facts()
        for one in facts.values():
            one.check_rollouts()
        if tensor_sync:
            check_tensor_sync(facts)

    async def weight_update_sessions(self) -> bool:
        """Whether the servers take updates only inside ``/begin_weight_update`` ...
        ``/end_weight_update`` (SGLang >= 0.5.21; older ones lack both endpoints)."""
        return same_protocol(await self.server_facts())

    async def begin_weight_update(self) -> None:
        """Open a sync on every server, where the servers have weight-update sessions."""
        if not await self.weight_update_sessions():
            return
        try:
            await self._all("POST", "/begin_weight_update", {"selector": "all"})
        except RequestRejectedError as err:
            if "already open" not in str(err):
                raise
            # a session left open by a sync that died half way (an earlier run): close it, the
            # sync about to run rewrites every weight, and open a fresh one on every server
            log.warning("closing a weight-update session left open on a rollout server: %s", err)
            await self._all("POST", "/end_weight_update", {})
            await self._all("POST", "/begin_weight_update", {"selector": "all"})

    async def update_weights_from_tensor(
        self,
        serialized: str,
        load_format: str = "safetensors",
        flush_cache: bool = True,
        weight_version: str | None = None,
        tp_size: int = 1,
    ) -> None:
        """One bucket, already serialized in ``load_format`` (one POST to every server): the
        payload and its bucketing are the sender's (``weight_sync.tensor``), not this client's.
        The last bucket of a sync carries ``weight_version`` and ``flush_cache``.

        ``load_format`` is a safe format the embedded server reads (``safetensors`` or
        ``torch``). Real SGLang decodes these payloads with its own (CUDA IPC) serializer, so
        against SGLang use ``update_weights_from_disk`` or the distributed NCCL path.
        """
        body = {
            "serialized_named_tensors": [serialized] * tp_size,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        await self._all("POST", "/update_weights_from_tensor", body)

    async def update_weight_version(self, version: str) -> None:
        """Label the open sync ``version`` (the servers switch weights and version together)."""
        await self._all("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    async def end_weight_update(self, failed: bool = False) -> None:
        """Close the sync. After a failed one (``failed``) close it on the servers that still
        answer, waiting on a hung server only the health policy: the sync's own error is the
        one worth reporting."""
        if not failed:
            if await self.weight_update_sessions():
                await self._all("POST", "/end_weight_update", {})
            return
        try:
            if await self.weight_update_sessions():
                await self._all("POST", "/end_weight_update", {}, policy=self.cfg.health_retry)
        except (ServerError, ServerMismatchError):
            pass

    async def pause_generation(self, mode: str = "retract") -> bool:
        """SGLang's ``/pause_generation`` on every server (``mode``: ``retract`` puts running
        requests back in the queue, ``in_place`` keeps them, ``abort`` ends them), so a weight
        update lands between decode steps and the paused requests go on under the new weights
        after :meth:`continue_generation`. Returns False, having paused nothing, when a server
        answers 404 (it lacks the endpoint): the update then lands between the requests the
        server schedules (between turns for the embedded server), which is the fallback."""
        if self._pause_supported is False:
            return False
        try:
            await self._all("POST", "/pause_generation", {"mode": mode}, expect_json=False)
        except RequestRejectedError as err:
            if err.status != 404:
                raise
            self._pause_supported = False
            if len(self.cfg.urls) > 1:  # some may have paused: let them go on
                await self.continue_generation(force=True)
            return False
        self._pause_supported = True
        return True

    async def continue_generation(self, force: bool = False) -> None:
        """``/continue_generation`` on every server after :meth:`pause_generation` paused them."""
        if not force and not self._pause_supported:
            return
        try:
            await self._all("POST", "/continue_generation", {}, expect_json=False)
        except RequestRejectedError as err:
            if err.status != 404 or not force:
                raise

    async def flush_cache(self, wait_idle_s: float = 0.0) -> None:
        """``/flush_cache`` on every server. SGLang refuses it (400) while requests run or wait;
        with ``wait_idle_s`` > 0 each server holds the call until it is idle, at most that long
        (its ``timeout`` query), then flushes or refuses."""
        path = "/flush_cache" if wait_idle_s <= 0 else f"/flush_cache?timeout={wait_idle_s:g}"
        policy = self.cfg.control_retry
        if wait_idle_s > 0:  # the call lasts as long as the server waits
            policy = replace(policy, timeout_s=policy.timeout_s + wait_idle_s)
        await self._all("POST", path, None, expect_json=False, policy=policy)

    async def health(self) -> dict[str, bool]:
        """``{url: healthy}`` without raising (each check bounded by ``health_retry``)."""

        async def one(url: str) -> bool:
            try:
                await check_health(self._sess(), "rollout", [url], self.cfg.health_retry)
                return True
            except ServerError:
                return False

        return dict(zip(self.cfg.urls, await asyncio.gather(*(one(u) for u in self.cfg.urls))))

    async def check_health(self, when: str = "") -> None:
        """Raise a :class:`ServerError` naming every server that does not answer ``/health``
        within ``health_retry`` (``when``, e.g. "before the rollout phase of step 3", ends the
        message)."""
        await check_health(self._sess(), "rollout", self.cfg.urls, self.cfg.health_retry, when)

    async def model_info(self, url: str | None = None) -> dict[str, Any]:
        url = url or self.cfg.urls[0]
        return await request(self._sess(), "GET", f"{url}/model_info", None, self.cfg.control_retry)
