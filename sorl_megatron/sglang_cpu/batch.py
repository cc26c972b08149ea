"""The scheduler's data: sequences, prefill units, the running batch and the prefix cache.

KV layout: one ``[rows, kv_heads, width, head_dim]`` tensor pair per layer; a row's tokens
sit at the columns where its attention mask is 1 (left padding, and a padding gap between a
cached prefix and the freshly prefilled suffix). Position ids are kept per row, so RoPE sees
every token at its true position whatever the padding. Leading columns that are padding in
every row are trimmed when sequences leave.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..common.protocol import GenRequest

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [rows, kv_heads, width, head_dim]


@dataclass
class Seq:
    """One sequence (one of a request's ``n`` samples)."""

    req: GenRequest
    sample: int
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version that produced each output token
    top: list[list[list[Any]]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    routing: list[np.ndarray] = field(default_factory=list)  # chunks [tokens, layers, k] from routing_from on
    routing_from: int = 0
    routing_end: int = 0
    input_logprobs: list[list[Any]] = field(default_factory=list)
    cached_tokens: int = 0
    kv_gen: int = -1  # generation of the weights its KV was computed with
    storable: int = 0  # deterministic mode: fed positions that may go to the prefix cache
    budget: int = 0


@dataclass
class Unit:
    """Tokens prefilled once for ``seqs`` (a request's n samples, or one retracted sequence)."""

    tokens: list[int]
    seqs: list[Seq]
    input_lp: bool
    hit: int = 0
    entry: CacheEntry | None = None


@dataclass
class CacheEntry:
    """A finished sequence's KV (and routing) kept by the prefix cache."""

    key: int
    ids: np.ndarray
    kv: KV  # per layer [kv_heads, tokens, head_dim]
    routing: np.ndarray | None  # [tokens, layers, k] or None


class PrefixCache:
    """Finished sequences' KV keyed by token ids; lookups return the longest common prefix.

    Entries that are a prefix of a newly stored sequence are dropped (the new one covers
    them); at most ``max_tokens`` tokens are kept, least recently used first out.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._next = 0
        self.tokens = 0
        self.lookups = self.hits = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> int:
        n = len(self._entries)
        self._entries.clear()
        self.tokens = 0
        return n

    def match(self, ids: np.ndarray) -> tuple[CacheEntry | None, int]:
        self.lookups += 1
        best, best_len = None, 0
        for e in self._entries.values():
            n = min(len(e.ids), len(ids))
            if n <= best_len or e.ids[0] != ids[0]:
                continue
            eq = e.ids[:n] == ids[:n]
            common = n if bool(eq.all()) else int(eq.argmin())
            if common > best_len:
                best, best_len = e, common
        if best is not None:
            self._entries.move_to_end(best.key)
        return best, best_len

    def note_hit(self, tokens: int) -> None:
        if tokens > 0:
            self.hits += 1
            self.hit_tokens += tokens

    def insert(self, ids: np.ndarray, kv: KV, routing: np.ndarray | None) -> None:
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        for key, e in list(self._entries.items()):
            m = len(e.ids)
            if e.ids[0] != ids[0]:
                continue
            if m <= n and np.array_equal(e.ids, ids[:m]):
                if m == n and e.routing is not None and routing is None:
                    self._entries.move_to_end(key)
                    return  # the same tokens, with routing: keep that one
                self._drop(key)
            elif m > n and np.array_equal(e.ids[:n], ids):
                self._entries.move_to_end(key)
                return  # already covered by a longer entry
        self._next += 1
        self._entries[self._next] = CacheEntry(self._next, ids, kv, routing)
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= len(self._entries.pop(key).ids)



def pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [extra, 0]
    return F.pad(t, pad)


class Batch:
    """The running sequences and their KV rows (scheduler thread only)."""

    def __init__(self, rows: list[Seq], kv: KV | None, mask: torch.Tensor, pos: torch.Tensor,
                 last: torch.Tensor, versions: list[str]):
        self.rows = rows
        self.kv = kv
        self.mask = mask  # [rows, width] long
        self.pos = pos  # [rows] position of the next token to feed
        self.last = last  # [rows, vocab] logits the next token is sampled from
        self.versions = versions  # weight version of each row's ``last``

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    @staticmethod
    def empty() -> "Batch":
        z = torch.zeros(0, dtype=torch.long)
        return Batch([], None, torch.zeros(0, 0, dtype=torch.long), z, torch.zeros(0, 0), [])

    def temps(self) -> torch.Tensor:
        return torch.tensor([s.req.params.temperature for s in self.rows], dtype=torch.float32)

    def select(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[k] for k in keep]
        self.versions = [self.versions[k] for k in keep]
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        if not keep:
            self.kv = None
            self.mask = self.mask[:, :0]
            return
        cut = int(self.mask.any(0).long().argmax())  # leading columns that are padding in every row
        self.mask = self.mask[:, cut:]
        self.kv = [(k.index_select(0, idx)[:, :, cut:], v.index_select(0, idx)[:, :, cut:]) for k, v in self.kv]

    def merge(self, other: "Batch") -> None:
        if not other.rows:
            return
        if not self.rows:
            self.__dict__.update(other.__dict__)
            return
        w = max(self.width, other.width)
        self.kv = [
            (torch.cat([pad_left(k1, w, 2), pad_left(k2, w, 2)]),
             torch.cat([pad_left(v1, w, 2), pad_left(v2, w, 2)]))
            for (k1, v1), (k2, v2) in zip(self.kv, other.kv)
        ]
        self.mask = torch.cat([pad_left(self.mask, w, 1), pad_left(other.mask, w, 1)])
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])
        self.rows += other.rows
        self.versions += other.versions

    def row_kv(self, r: int) -> KV:
        """Row ``r``'s own KV (its masked-in columns), ``[kv_heads, tokens, head_dim]`` per layer."""
        cols = self.mask[r].bool()
        return [(k[r][:, cols], v[r][:, cols]) for k, v in self.kv]
