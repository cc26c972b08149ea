"""Async client for Search-R1's ``POST /retrieve`` (the embedded server or Search-R1's own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from ..common.http import BadResponseError, RetryPolicy, check_health, request
from ..common.protocol import RETRIEVAL_API_KEY_ENV, bearer_headers
from .corpus import Passage


def _passage(item: Any, url: str) -> Passage:
    # With return_scores the item is {"document": {...}, "score": s}; without, the document.
    doc, score = (
        (item["document"], item.get("score")) if isinstance(item, dict) and "document" in item else (item, None)
    )
    if not isinstance(doc, dict) or "contents" not in doc:
        raise BadResponseError(f"{url}/retrieve returned an item without 'contents': {str(item)[:200]}")
    return Passage(
        id=str(doc.get("id", "")), contents=str(doc["contents"]), score=None if score is None else float(score)
    )


class RetrievalClient:
    """``await client.retrieve(queries, topk)`` -> one best-first passage list per query.

    ``policy`` bounds each ``/retrieve`` call, ``health_policy`` each ``/health`` check (the
    trainer passes the recipe's ``retrieval.*`` values).
    """

    def __init__(
        self,
        url: str,
        policy: RetryPolicy | None = None,
        topk: int = 3,
        api_key: str | None = None,
        health_policy: RetryPolicy | None = None,
    ):
        # Search-R1 recipes write the endpoint itself (http://host:8000/retrieve)
        self.url = url.rstrip("/").removesuffix("/retrieve")
        # defaults as the recipe's retrieval.*; a timeout is not retried (a hung server fails after timeout_s)
        self.policy = policy or RetryPolicy(timeout_s=30.0, retries=2)
        self.health_policy = health_policy or RetryPolicy(timeout_s=10.0, retries=2)
        self.topk = topk
        # For a server started with --api-key; None uses $SORL_RETRIEVAL_API_KEY if set.
        self._headers = bearer_headers(api_key, RETRIEVAL_API_KEY_ENV)
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def retrieve(self, queries: Sequence[str], topk: int | None = None) -> list[list[Passage]]:
        payload = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        data = await request(self._sess(), "POST", f"{self.url}/retrieve", payload, self.policy)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise BadResponseError(
                f"{self.url}/retrieve: expected 'result' with {len(queries)} lists, got {str(data)[:200]}"
            )
        return [[_passage(item, self.url) for item in row] for row in result]

    async def check_health(self, when: str = "") -> None:
        """Raise a ``ServerError`` naming the server if ``/health`` does not answer within
        ``health_policy`` (``when``, e.g. "before the rollout phase of step 3", ends the message)."""
        await check_health(self._sess(), "retrieval", [self.url], self.health_policy, when)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "RetrievalClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
