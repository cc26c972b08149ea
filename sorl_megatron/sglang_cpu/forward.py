"""The scheduler's forwards: prefilling admitted prompts into a batch, one decode step, and the
prefix cache's lookups and stores.

Prefix cache (SGLang's radix cache, flat): a finished sequence's KV (prompt + output but the
last, unfed, token) is stored keyed by its token ids (``store``); a later request reuses the KV
of its longest common prefix with any stored sequence (``lookup``; at least one prompt token is
always prefilled) and reports the reused length in ``meta_info.cached_tokens``. A sequence
whose KV spans a weight change is not stored. The cache itself is ``batch.PrefixCache``.

Deterministic mode: every prompt is prefilled in chunks aligned at multiples of
``DETERMINISTIC_CHUNK`` tokens, as it would be alone (batch of one, no padding:
``prefill_chunked``); prefix-cache hits are rounded down to such a multiple and only the
chunk-prefilled part of a sequence is stored. Prompts admitted together (``prefill_rowwise``)
and decode steps run all rows in one forward under ``rowwise.RowwiseMode``, which computes each
row bit for bit as a forward of that row alone would. A request with ``sampling_seed`` then gets
the same tokens and log-probs whatever else is in flight and whatever the cache holds.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import KV, Batch, Seq, Unit, pad_left
from .model import ServedModel
from .rowwise import RowwiseMode

DETERMINISTIC_CHUNK = 32  # prefill chunk (and prefix-cache granularity) of the deterministic mode


def lookup(served: ServedModel, u: Unit) -> None:
    """Set ``u.hit`` / ``u.entry`` to the cached prefix its prefill may reuse (none: 0)."""
    if not served.cfg.enable_prefix_cache or not len(served.prefix_cache):
        return
    entry, common = served.prefix_cache.match(np.asarray(u.tokens, dtype=np.int64))
    if entry is None:
        return
    hit = min(common, len(u.tokens) - 1)  # at least one token is prefilled (its logits are sampled)
    req = u.seqs[0].req
    if u.input_lp:  # prompt log-probs need the logits from position logprob_start_len - 1 on
        hit = min(hit, max(req.logprob_start_len, 1) - 1)
    if req.return_routed_experts and entry.routing is None:  # routing of reused positions unknown
        hit = min(hit, min(s.routing_end if s.routing else req.routed_experts_start_len for s in u.seqs))
    if served.cfg.deterministic:
        hit = hit // DETERMINISTIC_CHUNK * DETERMINISTIC_CHUNK
    if hit > 0:
        u.hit, u.entry = hit, entry
        served.prefix_cache.note_hit(hit)


def prefill(served: ServedModel, units: list[Unit]) -> Batch:
    """Prefill ``units`` together: row ``i`` is [pad | cached prefix | pad | suffix]."""
    hits = [u.hit for u in units]
    lens = [len(u.tokens) for u in units]
    sufs = [n - h for n, h in zip(lens, hits)]
    P, S, U = max(hits), max(sufs), len(units)
    ids = torch.full((U, S), served.pad_id, dtype=torch.long)
    pos = torch.zeros((U, S), dtype=torch.long)
    mask = torch.zeros((U, P + S), dtype=torch.long)
    for i, u in enumerate(units):
        ids[i, S - sufs[i] :] = torch.tensor(u.tokens[hits[i] :])
        pos[i, S - sufs[i] :] = torch.arange(hits[i], lens[i])
        mask[i, P - hits[i] : P] = 1
        mask[i, P + S - sufs[i] :] = 1
    kv = None
    if P > 0:
        ref = next(u.entry for u in units if u.entry is not None).kv
        kv = []
        for layer, (k0, v0) in enumerate(ref):
            k = k0.new_zeros((U, k0.shape[0], P, k0.shape[2]))
            v = v0.new_zeros((U, v0.shape[0], P, v0.shape[2]))
            for i, u in enumerate(units):
                if hits[i]:
                    k[i, :, P - hits[i] :] = u.entry.kv[layer][0][:, : hits[i]]
                    v[i, :, P - hits[i] :] = u.entry.kv[layer][1][:, : hits[i]]
            kv.append((k, v))
    keep = max((n - max(u.seqs[0].req.logprob_start_len, 1) + 1 for n, u in zip(lens, units) if u.input_lp),
               default=1)
    want_routing = served.wants_routing(s for u in units for s in u.seqs)
    served.tap.active = want_routing
    logits, kv = served.run(ids, mask, pos, kv, keep)
    served.tap.active = False
    routing = served.tap.take(U, S) if want_routing else None
    for i, u in enumerate(units):
        if u.input_lp:
            _input_logprobs(u, logits[i], keep)
        for s in u.seqs:
            _prefilled(served, s, u, None if routing is None else routing[i, S - sufs[i] :])
    idx = torch.tensor([i for i, u in enumerate(units) for _ in u.seqs], dtype=torch.long)
    return Batch(
        rows=[s for u in units for s in u.seqs],
        kv=[(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv],
        mask=mask[idx],
        pos=torch.tensor(lens, dtype=torch.long)[idx],
        last=logits[:, -1].index_select(0, idx),
        versions=[served.weight_version] * len(idx),
    )


def prefill_chunked(served: ServedModel, u: Unit) -> Batch:
    """Deterministic mode: one unit alone, in chunks ending at multiples of DETERMINISTIC_CHUNK."""
    n, h, C = len(u.tokens), u.hit, DETERMINISTIC_CHUNK
    kv = None if u.entry is None else [(k[None, :, :h], v[None, :, :h]) for k, v in u.entry.kv]
    want_routing = served.wants_routing(u.seqs)
    parts, routes, a = [], [], h
    while a < n:
        b = min((a // C + 1) * C, n)
        served.tap.active = want_routing
        logits, kv = served.run(
            torch.tensor(u.tokens[a:b])[None], torch.ones((1, b), dtype=torch.long),
            torch.arange(a, b)[None], kv, (b - a) if u.input_lp else 1,
        )
        served.tap.active = False
        parts.append(logits[0])
        if want_routing:
            routes.append(served.tap.take(1, b - a)[0])
        a = b
    if u.input_lp:
        _input_logprobs(u, torch.cat(parts), n - h)
    routing = np.concatenate(routes) if routes else None
    for s in u.seqs:
        _prefilled(served, s, u, routing)
        s.storable = n // C * C
    m = len(u.seqs)
    return Batch(
        rows=list(u.seqs),
        kv=[(k.expand(m, -1, -1, -1).contiguous(), v.expand(m, -1, -1, -1).contiguous()) for k, v in kv],
        mask=torch.ones((m, n), dtype=torch.long),
        pos=torch.full((m,), n, dtype=torch.long),
        last=logits[:, -1].expand(m, -1).contiguous(),
        versions=[served.weight_version] * m,
    )


def prefill_rowwise(served: ServedModel, units: list[Unit]) -> Batch:
    """Deterministic mode, several units (no prompt log-probs) at once: each round feeds every
    unfinished unit its next ``prefill_chunked`` chunk, all in one forward under ``RowwiseMode``,
    so every row's logits, KV and routing are bit for bit those of ``prefill_chunked`` alone.
    Rows are left-padded to the round's longest chunk; between rounds each row's KV (cached
    prefix, then its chunks) is moved to the right end of the padded width, where the mode
    reads a row's past."""
    C = DETERMINISTIC_CHUNK
    ends = [len(u.tokens) for u in units]
    at = [u.hit for u in units]  # tokens each row has fed (its own KV columns)
    want_routing = served.wants_routing(s for u in units for s in u.seqs)
    routes: list[list[np.ndarray]] = [[] for _ in units]
    done: list[tuple[KV, torch.Tensor] | None] = [None] * len(units)  # a finished row's own KV and last logits
    rows = list(range(len(units)))  # unfinished units, by index
    kv = None
    if any(at):  # cached prefixes, right-aligned
        width, ref = max(at), next(u.entry.kv for u in units if u.hit)

        def cached(u: Unit, layer: int, j: int) -> torch.Tensor:
            return pad_left((u.entry.kv if u.hit else ref)[layer][j][:, : u.hit], width, 1)

        kv = [tuple(torch.stack([cached(u, layer, j) for u in units]) for j in (0, 1)) for layer in range(len(ref))]
    while rows:
        a = torch.tensor([at[i] for i in rows])
        b = torch.minimum((a // C + 1) * C, torch.tensor([ends[i] for i in rows]))
        new = b - a
        R, T = len(rows), int(new.max())
        past_w = 0 if kv is None else kv[0][0].shape[2]
        ids = torch.full((R, T), served.pad_id, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, T - int(new[j]) :] = torch.tensor(units[i].tokens[at[i] : int(b[j])])
        col = torch.arange(T)[None] - (T - new)[:, None]  # index within the row's new tokens (< 0: padding)
        pos = (a[:, None] + col).clamp(min=0)
        # the mask the model sees (the mode reads each row's own columns itself): past, then new
        mask = torch.cat([torch.arange(past_w)[None] >= (past_w - a)[:, None], col >= 0], 1).long()
        served.tap.active = want_routing
        with RowwiseMode(b, new, served.experts, served.kv_heads):
            logits, kv = served.run(ids, mask, pos, kv, 1)
        served.tap.active = False
        if want_routing:
            routing = served.tap.take(R, T)
            for j, i in enumerate(rows):
                routes[i].append(routing[j, T - int(new[j]) :])
        # each row's own columns (past, then new) moved to the right end of width max(b)
        width = int(b.max())
        t = torch.arange(width)[None] - (width - b)[:, None]  # index within the row's own tokens (< 0: padding)
        src = torch.where(t < a[:, None], past_w - a[:, None] + t, past_w + T - new[:, None] + t - a[:, None])
        idx = src.clamp(min=0)[:, None, :, None]
        kv = [(k.gather(2, idx.expand(-1, k.shape[1], -1, k.shape[3])),
               v.gather(2, idx.expand(-1, v.shape[1], -1, v.shape[3]))) for k, v in kv]
        keep = []
        for j, i in enumerate(rows):
            at[i] = int(b[j])
            if at[i] == ends[i]:
                done[i] = ([(k[j, :, width - at[i] :], v[j, :, width - at[i] :]) for k, v in kv], logits[j, -1])
            else:
                keep.append(j)
        if keep and len(keep) < R:
            sel = torch.tensor(keep)
            cut = width - max(at[rows[j]] for j in keep)  # leading columns now padding in every row
            kv = [(k[sel, :, cut:], v[sel, :, cut:]) for k, v in kv]
        rows = [rows[j] for j in keep]
    for u, r in zip(units, routes):
        for s in u.seqs:
            _prefilled(served, s, u, np.concatenate(r) if r else None)
            s.storable = len(u.tokens) // C * C
    width = max(ends)
    idx = torch.tensor([i for i, u in enumerate(units) for _ in u.seqs], dtype=torch.long)
    kv = [tuple(torch.stack([pad_left(own[layer][j], width, 1) for own, _ in done]).index_select(0, idx)
                for j in (0, 1)) for layer in range(len(done[0][0]))]
    n = torch.tensor(ends)[idx]
    return Batch(
        rows=[s for u in units for s in u.seqs],
        kv=kv,
        mask=(torch.arange(width)[None] >= (width - n)[:, None]).long(),
        pos=n,
        last=torch.stack([last for _, last in done]).index_select(0, idx),
        versions=[served.weight_version] * len(idx),
    )


def _prefilled(served: ServedModel, s: Seq, u: Unit, routing: np.ndarray | None) -> None:
    """Bookkeeping of a sequence just prefilled; ``routing`` covers positions [hit, len)."""
    if not s.out and not s.routing:
        s.cached_tokens = u.hit
    s.kv_gen = served.gen
    s.storable = len(u.tokens)
    if routing is None or not s.req.return_routed_experts:
        return
    if not s.routing:  # first prefill: routing of the reused prefix comes with the cache entry
        if u.hit and u.entry is not None and u.entry.routing is not None:
            s.routing, s.routing_from, s.routing_end = [u.entry.routing[: u.hit]], 0, u.hit
        else:
            s.routing_from = s.routing_end = u.hit
    s.routing.append(routing[s.routing_end - u.hit :])
    s.routing_end = len(u.tokens)


def _input_logprobs(u: Unit, logits: torch.Tensor, keep: int) -> None:
    """Prompt log-probs from ``logits`` [keep, vocab] of the unit's last ``keep`` positions."""
    req = u.seqs[0].req
    start, n = req.logprob_start_len, len(u.tokens)
    t = req.params.temperature or 1.0
    toks = torch.tensor(u.tokens)
    first = max(start, 1)  # token j is scored by the logits at position j - 1
    rows = logits[keep - (n - first + 1) : keep - 1]
    lp = torch.log_softmax(rows / t, dim=-1).gather(-1, toks[first:, None])[:, 0].tolist()
    values: list[float | None] = ([None] if start == 0 else []) + lp
    res = [[v, tok, None] for v, tok in zip(values, toks[start:].tolist())]
    for s in u.seqs:
        s.input_logprobs = res


def decode_forward(served: ServedModel, b: Batch, tokens: torch.Tensor, rows: list[int], want_routing: bool):
    """Feed one token per row ``rows`` of ``b``; returns (kv, mask, last logits, routing [rows, layers, k])."""
    if len(rows) == len(b):
        kv, mask, pos = b.kv, b.mask, b.pos
    else:
        idx = torch.tensor(rows, dtype=torch.long)
        kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in b.kv]
        mask, pos = b.mask[idx], b.pos[idx]
    mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], dim=1)
    served.tap.active = want_routing
    if served.cfg.deterministic:  # each row exactly as if forwarded alone, on its own last pos + 1 columns
        with RowwiseMode(pos + 1):
            logits, kv = served.run(tokens[:, None], None, pos[:, None], kv, 1)
    else:
        logits, kv = served.run(tokens[:, None], mask, pos[:, None], kv, 1)
    served.tap.active = False
    routing = served.tap.take(len(rows), 1)[:, 0] if want_routing else None
    return kv, mask, logits[:, -1], routing


def store(served: ServedModel, b: Batch, k: int) -> None:
    """Put row ``k``'s KV into the prefix cache (only if computed with the weights served now)."""
    s = b.rows[k]
    if s.kv_gen != served.gen or b.kv is None:
        return
    n = int(b.pos[k])  # fed positions: prompt + output but the last token
    if served.cfg.deterministic:
        n = min(n, s.storable)
    if n <= 0:
        return
    ids = np.asarray((list(s.req.input_ids) + s.out)[:n], dtype=np.int64)
    kv = [(key[:, :n], val[:, :n]) for key, val in b.row_kv(k)]
    routing = None
    if s.req.return_routed_experts and s.routing and s.routing_from == 0 and s.routing_end >= n:
        routing = np.concatenate(s.routing)[:n]
    served.prefix_cache.insert(ids, kv, routing)
