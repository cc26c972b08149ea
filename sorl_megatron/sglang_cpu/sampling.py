"""Sampling one token per running row, finishing sequences, and the answers' ``meta_info``.

Log-probs are ``log_softmax(logits / temperature)`` of the sampled token (temperature 0
means greedy and is scored at temperature 1), i.e. the quantity a trainer recomputes at
the same temperature; top-p/top-k truncation changes what is sampled, not the reported
log-prob.
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Any

import numpy as np
import torch

from ..common.protocol import encode_routed_experts
from .batch import Seq
from .model import ServedModel


def abort_reason() -> dict[str, Any]:
    return {"type": "abort", "message": "aborted by /abort_request", "status_code": 499, "err_type": "Abort"}


class Sampler:
    """Samples with the server's seeded generator (requests without ``sampling_seed``) or each
    sequence's own (``sampling_seed + sample index``); scheduler thread only."""

    def __init__(self, served: ServedModel, random_seed: int):
        self.served = served
        self._generator = torch.Generator().manual_seed(random_seed)

    def sample_rows(self, logits: torch.Tensor, seqs: list[Seq], temps: torch.Tensor):
        """Sample one token per row; returns tokens and their log-probs (see module doc). Every op
        works row by row (the softmaxes' sums run along a row, whatever the row count), so a seeded
        row's token and log-prob do not depend on the other rows (tests/rollout/test_rowwise_decode.py)."""
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        # min_new_tokens: stop tokens are not allowed yet.
        for k, s in enumerate(seqs):
            if len(s.out) < s.req.params.min_new_tokens:
                ban = list(s.req.params.stop_token_ids) + ([] if s.req.params.ignore_eos else list(self.served.eos_ids))
                scaled[k, ban] = float("-inf")
        logprobs = torch.log_softmax(scaled, dim=-1)
        filtered = self._truncate(scaled, seqs)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.empty(len(seqs), dtype=torch.long)
        seeded = [k for k, s in enumerate(seqs) if s.generator is not None]
        free = [k for k, s in enumerate(seqs) if s.generator is None]
        if free:
            tokens[free] = torch.multinomial(probs[free], 1, generator=self._generator)[:, 0]
        for k in seeded:
            tokens[k] = torch.multinomial(probs[k], 1, generator=seqs[k].generator)[0]
        tokens = torch.where(greedy, scaled.argmax(-1), tokens)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]

    @staticmethod
    def _truncate(scaled: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
        vocab = scaled.shape[-1]
        params = [s.req.params for s in seqs]
        if all(p.top_k >= vocab and p.top_p >= 1 and p.min_p <= 0 for p in params):  # nothing to cut (every step)
            return scaled
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        values, order = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(values, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each rank
        ranks = torch.arange(vocab)[None, :]
        drop = (ranks >= top_k[:, None]) | (before > top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
        drop[:, 0] = False  # the best token always survives
        values = values.masked_fill(drop, float("-inf"))
        return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)

    def append(self, s: Seq, tok: int, lp: float, logits: torch.Tensor, temp: torch.Tensor, version: str,
               aborted: Container[str]) -> None:
        """Add token ``tok`` to ``s`` and set ``s.finish`` if that ends it (``aborted``: rids of
        /abort_request)."""
        p = s.req.params
        s.out.append(tok)
        s.logprobs.append(lp)
        s.versions.append(version)
        if s.req.return_logprob and s.req.top_logprobs_num > 0:
            t = float(temp) or 1.0
            top = torch.log_softmax(logits / t, dim=-1).topk(s.req.top_logprobs_num)
            s.top.append([[v, i, None] for v, i in zip(top.values.tolist(), top.indices.tolist())])
        if s.req.rid in aborted or s.req.future.cancelled():
            s.finish = abort_reason()
        elif tok in p.stop_token_ids or (not p.ignore_eos and tok in self.served.eos_ids):
            if len(s.out) > p.min_new_tokens or tok in p.stop_token_ids:
                s.finish = {"type": "stop", "matched": tok}
        elif p.stop and self.served.tokenizer is not None:
            width = max(len(x) for x in p.stop) + 1
            tail = self.served.tokenizer.decode(s.out[-width:], skip_special_tokens=False)
            hit = next((x for x in p.stop if x in tail), None)
            if hit is not None:
                s.finish = {"type": "stop", "matched": hit}
        if s.finish is None and len(s.out) >= s.budget:
            s.finish = {"type": "length", "length": len(s.out)}

    def result(self, s: Seq) -> dict[str, Any]:
        """One sequence's answer as SGLang's ``/generate`` gives it."""
        req, p = s.req, s.req.params
        out, lps, top, vers = list(s.out), list(s.logprobs), list(s.top), list(s.versions)
        fr = s.finish or {"type": "length", "length": len(out)}
        matched = fr.get("matched")
        if not p.no_stop_trim and isinstance(matched, int) and out and out[-1] == matched:
            out, lps, top, vers = out[:-1], lps[:-1], top[:-1], vers[:-1]
        meta: dict[str, Any] = {
            "id": req.rid if (req.total_n or p.n) == 1 else f"{req.rid}-{s.sample}",
            "finish_reason": fr,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(s.out),
            "cached_tokens": s.cached_tokens,
            "weight_version": s.versions[-1] if s.versions else self.served.weight_version,
            "output_token_weight_versions": vers,
            "e2e_latency": time.perf_counter() - req.arrival,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            meta["input_token_logprobs"] = s.input_logprobs
            if req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = top
        if req.return_routed_experts and s.routing:
            full = np.concatenate(s.routing, axis=0)  # positions [routing_from, routing_end)
            n_fed = len(req.input_ids) + len(s.out) - 1
            lo = req.routed_experts_start_len - s.routing_from
            meta["routed_experts"] = encode_routed_experts(full[lo : n_fed - s.routing_from])
        result: dict[str, Any] = {"output_ids": out, "meta_info": meta}
        if self.served.tokenizer is not None:
            text = self.served.tokenizer.decode(out, skip_special_tokens=p.skip_special_tokens)
            if isinstance(matched, str) and not p.no_stop_trim and matched in text:
                text = text[: text.rfind(matched)]
            result["text"] = text
        return result
