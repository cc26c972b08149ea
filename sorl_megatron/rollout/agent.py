"""The multi-turn search agent loop (Search-R1 protocol), tokens in and tokens out.

Each turn sends the whole token history to the rollout server and appends the sampled ids
exactly as returned (never re-tokenized), with their behaviour log-probs and the weight version
that sampled each of them (so an episode that spans a weight update, a partial rollout, keeps
both token by token; docs/concepts/rollout.md, "Rollout modes"). A turn stops at ``</search>``, ``</answer>``, EOS or
its token budget. ``<search> q </search>`` calls the retriever and appends
``<information>...</information>`` observation tokens; a turn with neither a search nor an
answer gets a correction message as its observation. Observations carry loss mask 0. The
episode ends at an answer, EOS, the turn limit or the length limit.

The environment's own messages contain no action tags (``<search>``, ``<answer>``, ...), and
rewards read only the policy's turns (``Trajectory.turn_texts``), so neither a message nor a
retrieved passage can be taken for the policy's action or answer.

The environment failing one episode never fails the others: a search the retrieval server
rejects (HTTP 4xx, e.g. a query over its length limit) or cannot serve (unreachable, timed
out, 5xx or 429 after the client's retries) becomes an observation saying so and is counted
in ``Trajectory.retrieval_errors``; a generation request the rollout server rejects (4xx)
ends that episode with ``finish_reason="error"`` (logged, with the first refusal, by
``run_many``). Only what fails every episode alike ends the whole ``run_many``, cancelling its
other episodes: a rollout server that is down, an answer that breaks the protocol
(``ProtocolError``), a retrieval server answering 404 / 401 / 403 (wrong URL or credentials);
and a ``run_many`` whose every episode was refused raises the first refusal.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np
from tqdm import tqdm

from ..common.http import RequestRejectedError, ServerError
from ..common.protocol import GenerateOutput, SamplingParams, compact_route_dtype
from ..retrieval.corpus import Passage, format_passages
from .trajectory import Trajectory, version_number

log = logging.getLogger("sorl_megatron.rollout.agent")

# The correction observation after a turn with no valid action. Search-R1's wording, with
# the tags named instead of written: its original text contains "<answer> and </answer>",
# which a reward reading the whole response took for the answer "and".
INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "the search tags. If I want to give the final answer, I should put the answer between "
    "the answer tags. Let me try again.\n"
)
# Observation bodies of a search that returned no passages (wrapped in <information> tags).
SEARCH_REJECTED_MESSAGE = "The search was rejected by the retrieval server: use a shorter, plain query."
SEARCH_FAILED_MESSAGE = "The search failed: the retrieval server did not answer. No results."
# What a retriever may raise for one search (common.http wraps HTTP failures in ServerError).
RETRIEVAL_ERRORS = (ServerError, aiohttp.ClientError, OSError)
# 4xx answers that refuse this query (bad or too long: 400 ours, 422 FastAPI's, 413/414 size);
# any other 4xx (404 wrong URL, 401/403 credentials) refuses every query: a setup error, raised.
QUERY_REJECTED_STATUS = (400, 413, 414, 422)
_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


class Policy(Protocol):
    """What the loop needs from a rollout backend (``RolloutClient`` is one)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> list[GenerateOutput]: ...


class Retriever(Protocol):
    async def retrieve(self, queries: Sequence[str], topk: int | None = None) -> list[list[Passage]]: ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class AgentConfig:
    """Limits and sampling of the agent loop (SORL: 3 turns; SAPO/PVPO: 4-5).

    Attributes:
        max_turns: policy turns per episode; the last turn's search is not executed.
        max_turn_tokens: sampled tokens per turn.
        max_total_tokens: prompt + responses + observations.
        max_obs_tokens: observation tokens per search (passages are cut, tags kept).
        topk: passages per search.
        return_routed_experts: ask the server for routing (MoE, R3 replay).
    """

    max_turns: int = 4
    max_turn_tokens: int = 500
    max_total_tokens: int = 4096
    max_obs_tokens: int = 500
    topk: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ("</search>", "</answer>")
    return_routed_experts: bool = False
    max_concurrency: int = 256

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_total_tokens", "max_obs_tokens", "topk", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent.{name} must be >= 1, got {getattr(self, name)}")


def parse_action(text: str) -> tuple[str | None, str]:
    """``("search", query)``, ``("answer", answer)`` or ``(None, "")`` for an invalid turn.

    A turn with an answer block answers, with its *last* one: the block the reward reads
    (``rewards.qa.extract_answer``), so the episode's answer and its score never disagree (a
    server that ignores the stop strings can return several). Otherwise its first search."""
    blocks = _ACTION_RE.findall(text)
    answers = [content for kind, content in blocks if kind == "answer"]
    if answers:
        return "answer", answers[-1].strip()
    if not blocks:
        return None, ""
    kind, content = blocks[0][0], blocks[0][1].strip()
    if kind == "search" and not content:
        return None, ""
    return kind, content


class _Builder:
    """Accumulates one episode's aligned arrays."""

    def __init__(self, prompt: Sequence[int], routed: bool):
        self.ids: list[np.ndarray] = [np.asarray(prompt, dtype=np.int64)]
        self.mask: list[np.ndarray] = [np.zeros(len(prompt), np.int8)]
        self.turn: list[np.ndarray] = [np.full(len(prompt), -1, np.int32)]
        self.lps: list[np.ndarray] = [np.zeros(len(prompt), np.float32)]
        self.versions: list[np.ndarray] = [np.full(len(prompt), -1, np.int64)]
        self.routing: list[np.ndarray] | None = [] if routed else None
        self.routing_versions: list[np.ndarray] = []
        self.length = len(prompt)
        self.routed_len = 0  # positions whose routing we hold

    def tokens(self) -> list[int]:
        return np.concatenate(self.ids).tolist()

    def add_policy(self, out: GenerateOutput, turn: int) -> None:
        n = len(out.output_ids)
        self.ids.append(np.asarray(out.output_ids, dtype=np.int64))
        self.mask.append(np.ones(n, np.int8))
        self.turn.append(np.full(n, turn, np.int32))
        self.lps.append(np.asarray(out.output_logprobs, dtype=np.float32))
        versions = token_versions(out)
        self.versions.append(versions)
        self.length += n
        if self.routing is not None and out.routed_experts is not None:
            self.routing.append(out.routed_experts)
            self.routed_len += out.routed_experts.shape[0]
            # the prefill (up to the prompt's last position) ran with the version of the first
            # sampled token; output position i is fed to sample token i + 1, under its version
            chunk = out.routed_experts.shape[0]
            fed_outputs = min(max(n - 1, 0), chunk)
            self.routing_versions.append(np.concatenate([
                np.full(chunk - fed_outputs, versions[0] if n else version_number(out.weight_version), np.int64),
                versions[1 : 1 + fed_outputs],
            ]))

    def add_observation(self, ids: Sequence[int]) -> None:
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.mask.append(np.zeros(len(ids), np.int8))
        self.turn.append(np.full(len(ids), -1, np.int32))
        self.lps.append(np.zeros(len(ids), np.float32))
        self.versions.append(np.full(len(ids), -1, np.int64))
        self.length += len(ids)

    def routed_experts(self) -> np.ndarray | None:
        if self.routing is None or not self.routing:
            return None
        got = np.concatenate(self.routing)
        out = np.full((self.length, *got.shape[1:]), -1, compact_route_dtype(got))
        out[: got.shape[0]] = got
        return out

    def routing_version_array(self) -> np.ndarray | None:
        if self.routing is None or not self.routing_versions:
            return None
        got = np.concatenate(self.routing_versions)
        out = np.full(self.length, -1, np.int64)
        out[: got.shape[0]] = got
        return out


def token_versions(out: GenerateOutput) -> np.ndarray:
    """The weight version of each sampled token of one ``/generate`` answer: the server's
    ``meta_info.output_token_weight_versions`` when it reports them (a server that applies a
    weight update between decode steps), else the request's ``weight_version`` for every token
    (a server that updates weights between requests)."""
    n = len(out.output_ids)
    per_token = out.meta_info.get("output_token_weight_versions") if out.meta_info else None
    if isinstance(per_token, list) and len(per_token) == n:
        labels, which = np.unique(np.asarray(per_token, dtype=object).astype(str), return_inverse=True)
        return np.asarray([version_number(v) for v in labels], dtype=np.int64)[which]  # a few labels
    return np.full(n, version_number(out.weight_version), np.int64)


class SearchAgent:
    """Runs episodes against a rollout backend and a retriever."""

    def __init__(self, policy: Policy, retriever: Retriever, tokenizer: Tokenizer, cfg: AgentConfig | None = None):
        self.policy, self.retriever, self.tokenizer = policy, retriever, tokenizer
        self.cfg = cfg or AgentConfig()
        open_tag = tokenizer.encode("\n\n<information>", add_special_tokens=False)
        close_tag = tokenizer.encode("</information>\n\n", add_special_tokens=False)
        self._obs_tags = (open_tag, close_tag)
        self._invalid_ids = tokenizer.encode(INVALID_ACTION_MESSAGE, add_special_tokens=False)
        self._rejected_ids = self._wrap(tokenizer.encode(SEARCH_REJECTED_MESSAGE, add_special_tokens=False))
        self._failed_ids = self._wrap(tokenizer.encode(SEARCH_FAILED_MESSAGE, add_special_tokens=False))

    def _wrap(self, body: list[int]) -> list[int]:
        open_tag, close_tag = self._obs_tags
        room = max(self.cfg.max_obs_tokens - len(open_tag) - len(close_tag), 0)
        return open_tag + body[:room] + close_tag

    def observation_ids(self, passages: Sequence[Passage]) -> list[int]:
        """``<information>`` block of the passages, cut to ``max_obs_tokens`` (tags kept)."""
        return self._wrap(self.tokenizer.encode(format_passages(passages).strip(), add_special_tokens=False))

    async def _search(self, query: str) -> tuple[list[int], str | None, bool]:
        """Observation ids of one search, the error (None on success) and whether it was rejected."""
        try:
            passages = (await self.retriever.retrieve([query], self.cfg.topk))[0]
        except RequestRejectedError as err:
            if err.status in QUERY_REJECTED_STATUS:  # the query's fault (too long, ...): the policy can do better
                return self._rejected_ids, str(err), True
            if err.status != 429:  # 429 (overloaded) is transient: a failed search like a 5xx
                raise
            return self._failed_ids, str(err), False
        except RETRIEVAL_ERRORS as err:  # the server's fault, after the client's retries
            return self._failed_ids, f"{type(err).__name__}: {err}", False
        return self.observation_ids(passages), None, False

    def _sampling(self, budget: int, seed: int | None) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            max_new_tokens=budget,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k if c.top_k > 0 else 1 << 30,
            stop=list(c.stop),
            no_stop_trim=True,
            sampling_seed=seed,
        )

    async def run(
        self, prompt_ids: Sequence[int], seed: int | None = None, meta: dict[str, Any] | None = None
    ) -> Trajectory:
        """One episode from a tokenized prompt."""
        c = self.cfg
        meta = dict(meta or {})
        b = _Builder(prompt_ids, c.return_routed_experts)
        finish, answer, searches, turns, versions = "max_turns", None, 0, 0, []
        texts: list[str] = []
        errors = rejected = 0
        for turn in range(c.max_turns):
            room = c.max_total_tokens - b.length
            if room <= 0:
                finish = "max_length"
                break
            try:
                outs = await self.policy.generate(
                    b.tokens(),
                    self._sampling(min(c.max_turn_tokens, room), None if seed is None else seed * 1000 + turn),
                    return_logprob=True,
                    return_routed_experts=c.return_routed_experts,
                    routed_experts_start_len=b.routed_len,
                )
            except RequestRejectedError as err:  # this request is wrong (e.g. over the server's context)
                finish, meta["error"], meta["error_status"] = "error", str(err), err.status
                break
            out = outs[0]
            b.add_policy(out, turn)
            turns += 1
            versions.append(out.weight_version)
            text = self.tokenizer.decode(out.output_ids, skip_special_tokens=False)
            texts.append(text)
            kind, content = parse_action(text)
            if kind == "answer":
                finish, answer = "answer", content
                break
            if kind is None and out.finish_type == "stop" and isinstance(out.matched, int):
                finish = "eos"  # the policy ended the episode without answering
                break
            if turn == c.max_turns - 1:
                finish = "max_turns"
                break
            if kind is None and b.length >= c.max_total_tokens:
                finish = "max_length"
                break
            if kind == "search":
                obs, error, was_rejected = await self._search(content)
                searches += 1
                if error is not None:
                    errors += 1
                    rejected += was_rejected
                    meta["retrieval_error"] = error
            else:
                obs = self._invalid_ids
            if b.length + len(obs) >= c.max_total_tokens:  # no room to act on the observation
                finish = "max_length"
                break
            b.add_observation(obs)
        ids = np.concatenate(b.ids)
        return Trajectory(
            token_ids=ids,
            loss_mask=np.concatenate(b.mask),
            turn_ids=np.concatenate(b.turn),
            rollout_logprobs=np.concatenate(b.lps),
            prompt_len=len(prompt_ids),
            finish_reason=finish,
            num_turns=turns,
            num_searches=searches,
            routed_experts=b.routed_experts(),
            answer=answer,
            response_text=self.tokenizer.decode(ids[len(prompt_ids) :].tolist(), skip_special_tokens=False),
            weight_versions=versions,
            token_versions=np.concatenate(b.versions),
            routing_versions=b.routing_version_array(),
            meta=meta,
            turn_texts=texts,
            retrieval_errors=errors,
            retrieval_rejected=rejected,
        )

    async def run_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        seed: int | None = None,
        metas: Sequence[dict[str, Any]] | None = None,
        progress: bool = False,
    ) -> list[Trajectory]:
        """``n`` episodes per prompt, all in flight at once (bounded by ``max_concurrency``).

        Results are prompt-major: the n samples of prompt 0, then of prompt 1, ...; each
        trajectory's ``meta`` gets ``prompt_index`` and ``sample_index``. Searches that got no
        passages are logged once per call (the first error is named); an exception that does
        end the call cancels the episodes still in flight.
        """
        sem = asyncio.Semaphore(self.cfg.max_concurrency)
        bar = None
        if progress:
            bar = tqdm(total=len(prompts) * n, desc="rollouts", unit="traj")

        async def one(i: int, j: int) -> Trajectory:
            meta = {**(metas[i] if metas else {}), "prompt_index": i, "sample_index": j}
            s = None if seed is None else seed + i * n + j
            async with sem:
                traj = await self.run(prompts[i], seed=s, meta=meta)
            if bar is not None:
                bar.update(1)
            return traj

        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest: no orphaned requests
                tasks = [group.create_task(one(i, j)) for i in range(len(prompts)) for j in range(n)]
        except BaseExceptionGroup as eg:
            # re-raise the episode's own error (callers catch ServerError etc., not groups)
            raise eg.exceptions[0] from None
        finally:
            if bar is not None:
                bar.close()
        trajs = [t.result() for t in tasks]
        _report_rejected(trajs)
        failed = [t for t in trajs if t.retrieval_errors]
        if failed:
            log.warning(
                "%d of %d searches got no passages (%d rejected by the server); first: %s",
                sum(t.retrieval_errors for t in trajs), sum(t.num_searches for t in trajs),
                sum(t.retrieval_rejected for t in trajs), failed[0].meta["retrieval_error"],
            )
        return trajs


def _report_rejected(trajs: Sequence[Trajectory]) -> None:
    """Episodes a server refused a ``/generate`` of (``finish_reason`` error) are logged with the
    first refusal; when every episode was refused, the request itself is wrong (a server flag, a
    protocol mismatch), not one episode: that first refusal is raised."""
    refused = [t for t in trajs if t.finish_reason == "error"]
    if not refused:
        return
    first = refused[0].meta
    if len(refused) == len(trajs):
        raise RequestRejectedError(f"every episode ({len(trajs)}) ended with a refused /generate request; "
                                   f"first: {first.get('error')}", int(first.get("error_status") or 400))
    log.warning("%d of %d episodes ended with a refused /generate request; first: %s",
                len(refused), len(trajs), first.get("error"))
