"""The run's servers and clients, held by rank 0 alone (the only rank that talks HTTP).

:class:`Connections` starts the embedded retrieval server and the rollout fleet (or takes the
recipe's URLs), makes every client the run uses (each bounded by the recipe's ``rollout.*`` /
``retrieval.*`` timeouts and retries), checks health before each phase, pauses the servers
around a weight update where the rollout source asks for it, and plays ground-truth
trajectories (SFT's demonstrations, PVPO's injection). Other ranks hold ``None``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from ...common import aio
from ...common.http import RetryPolicy, ServerError
from ...data.gold import gold_plan, gold_trajectory
from ...data.qa import QARow, encode_prompt
from ...retrieval.client import RetrievalClient
from ...rewards.registry import RewardRegistry
from ...rollout.agent import AgentConfig, SearchAgent
from ...rollout.client import PauseClock, RolloutClient, RolloutClientConfig
from ...rollout.trajectory import Trajectory
from ...weight_sync.factory import transport_class
from ..groups.rollouts import RolloutResult, collect_rollouts
from ..recipe.config import TrainConfig
from .fleet import RolloutFleet, Worker, start_fleet
from .servers import EmbeddedServers, retrieval_server_spec, rollout_server_spec

log = logging.getLogger("sorl_megatron.trainer")


class Connections:
    """Rank 0's servers and clients for one run.

    ``pauses``: whether the servers pause generation for weight updates (the rollout source
    decides: async with ``rollout.async.pause_mode`` on); the clients' ``/generate`` calls then do not
    count paused time against ``rollout.timeout_s``.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, rows: list[QARow], tokenizer: Any, pauses: bool = False):
        self.cfg = cfg
        self.run_dir = run_dir
        self.rows = rows
        self.tokenizer = tokenizer
        self.retrieval_url: Optional[str] = cfg.retrieval.url
        self.rollout_urls: list[str] = []  # every worker: weight updates, flush_cache, health
        self.fleet: Optional[RolloutFleet] = None  # the workers, the router, failures and restarts
        self.api_keys: dict[str, str] = {}  # of the embedded servers; others: $SORL_*_API_KEY
        self.servers: Optional[EmbeddedServers] = None
        self.pauses = pauses
        # paused time does not count against a /generate call's rollout.timeout_s (at most
        # rollout.weight_sync.timeout_s per call): a turn paused for a slow sync is not timed out
        self.pause_clock = PauseClock(cfg.rollout.weight_sync.timeout_s)
        self._pause_supported: Optional[bool] = None
        self._routing_shape: Optional[tuple[int, int]] = None
        self._gold_cache: dict[int, Optional[Trajectory]] = {}  # ground truth by prompt index (None: none usable)

    # -- servers -----------------------------------------------------------------------

    def start_retrieval(self, servers: EmbeddedServers) -> None:
        """The recipe's retrieval server, or an embedded one on the recipe's corpus."""
        self.servers = servers
        self.api_keys = servers.api_keys  # filled as the servers start
        q = self.cfg.retrieval
        self.retrieval_url = q.url or servers.start(retrieval_server_spec(q.corpus, q.topk))

    def start_rollouts(self, stack: ExitStack, policy_path: str) -> None:
        """The rollout fleet (embedded servers on ``policy_path``, or the recipe's URLs)."""
        cfg, r = self.cfg, self.cfg.rollout
        self.fleet = start_fleet(r, self.run_dir, self.servers, lambda name: rollout_server_spec(
            policy_path, r.precision, cfg.rollout_routes, cfg.schedule.seed, name=name,
            health_timeout_s=r.fleet.start_timeout_s, deterministic=r.deterministic,
            route_flip=(r.inject.route_flip_fraction, r.inject.seed)))
        stack.callback(self.fleet.close)
        self.rollout_urls = self.fleet.urls()
        # refuse at once a server this run cannot use (its SGLang version, --skip-tokenizer-init, or
        # real SGLang under the tensor transport)
        only_embedded = transport_class(r).embedded_servers_only
        aio.run(self.with_client(lambda c: c.check_for_rollouts(only_embedded)))

    def get_fleet(self) -> RolloutFleet:
        """The run's fleet; one made of ``rollout_urls`` (external servers, no router) when
        they were set without one."""
        if self.fleet is None:
            r = self.cfg.rollout
            self.fleet = RolloutFleet(
                timeout_s=r.fleet.start_timeout_s, health=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries),
                run_dir=self.run_dir, workers=[], restart_command=r.fleet.restart_command,
                api_key=self.api_keys.get("rollout"))
        if not self.fleet.workers:
            self.fleet.workers = [Worker(u) for u in self.rollout_urls]
        return self.fleet

    def fleet_rejoining(self) -> bool:
        """No rollout server serves now, and a restarted one waits for a weight sync before it
        serves (``RolloutFleet.rejoining``); any thread."""
        return self.fleet is not None and self.fleet.rejoining()

    # -- clients -----------------------------------------------------------------------

    def agent_config(self, greedy: bool = False, routed_experts: Optional[bool] = None) -> AgentConfig:
        """The agent loop's limits and sampling, from the recipe (greedy: validation)."""
        r = self.cfg.rollout
        if routed_experts is None:
            routed_experts = self.cfg.rollout_routes
        return AgentConfig(
            max_turns=r.max_turns, max_turn_tokens=r.max_turn_tokens, max_total_tokens=r.max_total_tokens,
            max_obs_tokens=r.max_obs_tokens, topk=self.cfg.retrieval.topk,
            temperature=r.temperature, top_p=1.0 if greedy else r.top_p, top_k=1 if greedy else r.top_k,
            return_routed_experts=routed_experts, max_concurrency=r.concurrency,
        )

    def rollout_client(self) -> RolloutClient:
        """The one way the trainer talks to the rollout servers (generation, weight sync,
        health); every wait is bounded by the recipe's ``rollout.*`` timeouts and retries."""
        r, fleet = self.cfg.rollout, self.get_fleet()
        return RolloutClient(RolloutClientConfig(
            urls=tuple(self.rollout_urls), max_concurrency=r.concurrency,
            generate_retry=RetryPolicy(timeout_s=r.timeout_s, retries=r.retries),
            control_retry=RetryPolicy(timeout_s=r.weight_sync.timeout_s, retries=r.retries),
            health_retry=RetryPolicy(timeout_s=r.health_timeout_s, retries=r.retries),
            api_key=self.api_keys.get("rollout"), router_url=fleet.router_url,
            failover_retries=r.fleet.failover_retries, routing_shape=self.routing_shape()), on_failure=fleet.on_failure,
            serving=fleet.urls,  # a long-lived (async) client follows restarts
            on_retry=lambda: fleet.count("retries"),  # as they happen, from any thread
            pauses=self.pause_clock if self.pauses else None)

    def routing_shape(self) -> Optional[tuple[int, int]]:
        """``(layers, top_k)`` of the routed experts R3 asks for, from ``model.path``'s own
        ``config.json`` (SGLang's ``/model_info`` does not report it); None when the rollout
        returns no routes (``TrainConfig.rollout_routes``)."""
        if not self.cfg.rollout_routes:
            return None
        if self._routing_shape is None:
            from ...bridge.families import routing_shape
            from ...bridge.hf_config import load_hf_config

            self._routing_shape = routing_shape(load_hf_config(self.cfg.model.path))
        return self._routing_shape

    def retrieval_client(self) -> RetrievalClient:
        """The one way the trainer talks to the retrieval server, bounded by ``retrieval.*``."""
        q = self.cfg.retrieval
        return RetrievalClient(self.retrieval_url, topk=q.topk, api_key=self.api_keys.get("retrieval"),
                               policy=RetryPolicy(timeout_s=q.timeout_s, retries=q.retries),
                               health_policy=RetryPolicy(timeout_s=q.health_timeout_s, retries=q.retries))

    def agent(self, greedy: bool = False) -> tuple[SearchAgent, Any]:
        """A search agent on fresh clients, and the coroutine function that closes them."""
        policy, retriever = self.rollout_client(), self.retrieval_client()

        async def close() -> None:
            await policy.close()
            await retriever.close()

        return SearchAgent(policy, retriever, self.tokenizer, self.agent_config(greedy)), close

    async def with_client(self, fn):
        client = self.rollout_client()
        try:
            return await fn(client)
        finally:
            await client.close()

    # -- health ------------------------------------------------------------------------

    def check_servers(self, phase: str, retrieval: bool = True) -> None:
        """Before ``phase``: every server it uses answers ``GET /health`` within the recipe's
        ``*.health_timeout_s``, else a ``ServerError`` naming the server, what failed and the
        phase. Asked even when the policy never searches, so a dead retrieval server is noticed
        at once. The checks of both servers run at once."""
        when = f"before {phase}"

        async def go():
            clients = [self.retrieval_client()] if retrieval and self.retrieval_url else []
            # the rollout workers that fail are taken out (and restarted); an error only when none is left
            checks = [self.get_fleet().check(when)] if self.rollout_urls else []
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

        aio.run(go())

    # -- rollouts ----------------------------------------------------------------------

    def rollouts(self, indices: list[int], n: int, seed: int, rewards: RewardRegistry, greedy: bool = False,
                 rows: Optional[list[QARow]] = None) -> RolloutResult:
        """``n`` episodes for each of ``rows[i]`` (default: the training rows), scored by ``rewards``."""
        rows = self.rows if rows is None else rows

        async def go():
            agent, close = self.agent(greedy)
            try:
                return await collect_rollouts(agent, self.tokenizer, [rows[i] for i in indices], indices, n, rewards,
                                              seed=seed, max_prompt_tokens=self.cfg.data.max_prompt_tokens)
            finally:
                await close()

        return aio.run(go())

    # -- weight updates ----------------------------------------------------------------

    def prepare_sync(self) -> None:
        self.rollout_urls = self.get_fleet().prepare_sync()  # restarted servers get this sync too

    def finish_sync(self) -> None:
        self.get_fleet().finish_sync()  # ... and serve again: with the current weights
        self.rollout_urls = self.get_fleet().urls()

    def pause(self) -> bool:
        """``/pause_generation`` before a weight update where the rollout source pauses the
        servers; True when they paused. Servers without the endpoint apply the update between
        the requests they schedule, as they would anyway (docs/concepts/rollout.md)."""
        if not self.pauses or self._pause_supported is False:
            return False
        self.pause_clock.pause()  # before the call: a server pauses as soon as it is asked
        try:
            self._pause_supported = aio.run(
                self.with_client(lambda c: c.pause_generation(self.cfg.rollout.async_.pause_mode)))
        except Exception:
            # some servers may have paused before one failed: never leave them paused
            try:
                aio.run(self.with_client(lambda c: c.continue_generation(force=True)))
            except Exception as err:
                log.warning("after a failed /pause_generation, /continue_generation failed too: %s", err)
            self.pause_clock.resume()
            raise
        if not self._pause_supported:
            self.pause_clock.resume()
            log.info("the rollout servers have no /pause_generation: weight updates land between their requests")
        return self._pause_supported

    def resume(self) -> None:
        """``/continue_generation`` after a paused update (a fresh client: it has not seen the
        pause, so it must be told to continue)."""
        try:
            aio.run(self.with_client(lambda c: c.continue_generation(force=True)))
        finally:
            self.pause_clock.resume()

    # -- ground truth ------------------------------------------------------------------

    def gold_for(self, indices: list[int]) -> dict[int, Trajectory]:
        """Complete ground-truth trajectories of these prompts for PVPO injection, played once
        per prompt and kept (retrieval and gold plans do not change during a run)."""
        missing = [i for i in indices if i not in self._gold_cache]
        if missing:
            found = self.gold_trajectories(missing, complete_only=True)
            self._gold_cache.update({i: found.get(i) for i in missing})  # None: no usable ground truth
        return {i: self._gold_cache[i] for i in indices if self._gold_cache[i] is not None}

    def gold_trajectories(
        self, indices: list[int], complete_only: bool = False, plans: dict[int, Any] | None = None
    ) -> dict[int, Trajectory]:
        """Ground-truth trajectories of the given prompts, played through the agent loop.

        ``plans`` (index -> GoldPlan) replaces the rows' own gold plans (the SFT cold start's
        demonstrations); prompts without a plan are left out. With ``complete_only`` (PVPO
        injection, which scores them 1) a plan the rollout budgets cut before its answer
        (``max_turns``, ``max_turn_tokens``, ``max_total_tokens``) is left out: it is not a
        correct trajectory."""
        cfg = self.agent_config(routed_experts=False)  # a scripted policy has no routing
        out: dict[int, Trajectory] = {}

        async def go():
            retriever = self.retrieval_client()
            try:
                for i in indices:
                    row = self.rows[i]
                    plan = plans.get(i) if plans is not None else gold_plan(row)
                    if plan is None or i in out:
                        continue  # rows without a gold plan get no injection
                    out[i] = await gold_trajectory(
                        lambda pol: SearchAgent(pol, retriever, self.tokenizer, cfg),
                        self.tokenizer, encode_prompt(self.tokenizer, row), plan)
            finally:
                await retriever.close()

        aio.run(go())
        if complete_only:
            cut = sorted(i for i, t in out.items() if t.finish_reason != "answer")
            if cut:
                log.warning(
                    "ground truth of prompt(s) %s does not reach its answer within the rollout budgets; not injected",
                    cut,
                )
            out = {i: t for i, t in out.items() if i not in set(cut)}
        return out
