"""Validation of a ``/generate`` body into the engine's requests (SGLang's fields, docs/concepts/rollout.md).

Everything is checked before anything is queued; a bad field is a ``ProtocolError`` (HTTP 400)
naming it.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..common.protocol import GenRequest, ProtocolError, SamplingParams, _is_int, check_text, short
from .options import ServerOptions

if TYPE_CHECKING:  # the engine (torch, transformers) is not needed to validate
    from .engine import RolloutEngine

_SPLITS = itertools.count()  # ids of split n's: the engine queues a split's parts one after another


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n



def token_ids(value: Any, where: str, vocab: int) -> list[int]:
    """A non-empty list of ints in ``[0, vocab)``, checked in C (bodies hold millions of ids)."""
    if not isinstance(value, list) or not value:
        raise ProtocolError(f"{where} must be a non-empty list of token ids")
    if not set(map(type, value)) <= {int}:  # bool is not a token id
        k = next(i for i, t in enumerate(value) if type(t) is not int)
        raise ProtocolError(f"{where}[{k}] is {short(value[k])}, not an integer token id")
    try:
        arr = np.array(value, dtype=np.int64)
        ok = bool(arr.min() >= 0 and arr.max() < vocab)
    except OverflowError:
        ok = False
    if not ok:
        k = next(i for i, t in enumerate(value) if not 0 <= t < vocab)
        raise ProtocolError(f"{where}[{k}] = {short(value[k])} is not a token id in [0, {vocab})")
    return value


def parse_generate(
    body: Any, engine: RolloutEngine, opts: ServerOptions | None = None
) -> tuple[list[GenRequest], bool]:
    """Validate a ``/generate`` body into per-prompt requests; returns (requests, is_batch).

    Everything is checked before anything is queued, cheapest first (counts, lengths,
    totals, then every token id), so one bad element rejects the whole body with 400
    naming it (SGLang also rejects a batch whose element fails validation).
    """
    opts = opts or ServerOptions()
    if not isinstance(body, dict):
        raise ProtocolError("body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by the embedded server")
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise ProtocolError("one of input_ids or text is required")
    if ids is not None and text is not None:
        raise ProtocolError("give either input_ids or text, not both")
    vocab, ctx = engine.served.vocab_size, engine.served.context_length
    if ids is None:
        is_batch = isinstance(text, list)
        raw = text if is_batch else [text]
        name = "text"
    else:
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(ids[0], list)
        raw = ids if is_batch else [ids]
        name = "input_ids"
    if not raw:
        raise ProtocolError(f"{name} must not be an empty list")
    cap = opts.max_prompts_per_request
    if len(raw) > cap:
        raise ProtocolError(f"{len(raw)} prompts in one request; the limit is {cap} (--max-prompts-per-request)")
    n = len(raw)

    def where(field_name: str, i: int) -> str:
        return f"{field_name}[{i}]" if is_batch else field_name

    sps = _per_prompt(body.get("sampling_params"), n, "sampling_params")
    params = [SamplingParams.from_json(sps[i], where("sampling_params", i)) for i in range(n)]
    sequences = sum(p.n for p in params)
    if sequences > cap:
        raise ProtocolError(
            f"{sequences} sequences (prompts x n) in one request; the limit is {cap} (--max-prompts-per-request)"
        )
    if ids is None:
        if engine.served.tokenizer is None:
            raise ProtocolError("text input needs a tokenizer (server started with --skip-tokenizer-init)")
        for i, t in enumerate(raw):
            if not isinstance(t, str):
                raise ProtocolError(f"{where('text', i)} must be a string, got {type(t).__name__}")
            check_text(t, where("text", i))
        prompts = engine.served.tokenizer(list(raw), add_special_tokens=False)["input_ids"]
    else:
        prompts = raw
    total = 0
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if not isinstance(prompt, list) or not prompt:
            raise ProtocolError(f"{where(name, i)} must be a non-empty list of token ids")
        if len(prompt) >= ctx:
            raise ProtocolError(f"{where(name, i)} has {len(prompt)} tokens, the context length is {ctx}")
        total += sp.n * (len(prompt) + min(sp.max_new_tokens, ctx - len(prompt)))
    if total > opts.max_tokens_per_request:
        raise ProtocolError(
            f"the request asks for {total} tokens (prompt + max_new_tokens, times n, over its prompts); "
            f"the limit is {opts.max_tokens_per_request} (--max-tokens-per-request)"
        )
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        token_ids(prompt, where("input_ids", i), vocab)
        if sp.stop_token_ids:
            token_ids(sp.stop_token_ids, where("sampling_params", i) + ".stop_token_ids", vocab)
        if sp.stop and engine.served.tokenizer is None:
            raise ProtocolError(
                "stop strings need a tokenizer (server started with --skip-tokenizer-init); use stop_token_ids"
            )
    ret_lp = _per_prompt(body.get("return_logprob", False), n, "return_logprob")
    starts = _per_prompt(body.get("logprob_start_len", -1), n, "logprob_start_len")
    tops = _per_prompt(body.get("top_logprobs_num", 0), n, "top_logprobs_num")
    rids = _per_prompt(body.get("rid"), n, "rid")
    routed = body.get("return_routed_experts", False)
    r_start = body.get("routed_experts_start_len", 0)
    if not isinstance(routed, bool):
        raise ProtocolError("return_routed_experts must be a boolean")
    if routed and not engine.cfg.enable_return_routed_experts:
        raise ProtocolError("return_routed_experts needs the server flag --enable-return-routed-experts")
    if routed and not engine.served.is_moe:
        raise ProtocolError("return_routed_experts: the served model has no MoE routers")
    max_top = min(64, vocab)
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not isinstance(ret_lp[i], bool):
            raise ProtocolError(f"{where('return_logprob', i)} must be a boolean")
        if not _is_int(starts[i]) or not -1 <= starts[i] < len(p):
            raise ProtocolError(
                f"{where('logprob_start_len', i)} must be -1 or in [0, {len(p)}), got {short(starts[i])}"
            )
        if not _is_int(tops[i]) or not 0 <= tops[i] <= max_top:
            raise ProtocolError(
                f"{where('top_logprobs_num', i)} must be an integer in [0, {max_top}], got {short(tops[i])}"
            )
        if not _is_int(r_start) or not 0 <= r_start <= len(p):
            raise ProtocolError(f"routed_experts_start_len must be in [0, {len(p)}], got {short(r_start)}")
        if rids[i] is not None and not isinstance(rids[i], str):
            raise ProtocolError(f"{where('rid', i)} must be a string")
        if rids[i] is not None:
            check_text(rids[i], where("rid", i))
        kw = {"rid": rids[i]} if rids[i] else {}
        # n larger than a wave is split into wave-sized requests (seeds follow the sample index).
        step = max(1, engine.cfg.max_running_requests)
        split = next(_SPLITS) if sp.n > step else None
        for lo in range(0, sp.n, step):
            part = sp if sp.n <= step else replace(sp, n=min(step, sp.n - lo))
            reqs.append(
                GenRequest(
                    input_ids=list(p),
                    params=part,
                    return_logprob=ret_lp[i],
                    logprob_start_len=starts[i],
                    top_logprobs_num=tops[i],
                    return_routed_experts=routed,
                    routed_experts_start_len=r_start,
                    sample_offset=lo,
                    total_n=sp.n,
                    split=split,
                    **kw,
                )
            )
    return reqs, is_batch
