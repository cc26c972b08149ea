"""CPU generation engine behind the embedded SGLang-compatible server.

One scheduler thread owns the model. It takes every waiting request (up to
``max_running_requests`` sequences) into a *wave*: the prompts are left-padded and
prefilled together, then decoded together with a KV cache; finished sequences leave the
batch (their cache rows are dropped) so the rest decode at the live batch size. Control
operations (weight updates) run on the same thread between waves, so a wave always sees
one set of weights and reports that ``weight_version``; tensors sent between
``begin_update`` and ``end_update`` (and their version) take effect together at the end.

Isolation: requests are validated by the server before they get here; if a wave still
fails, each of its requests is retried alone, so only the one that fails gets the error.
A request asking for prompt log-probs runs in a wave of its own (its logits cost
``n x prompt positions x vocab`` floats). ``abort`` marks only requests that are queued or
running (SGLang ignores unknown ids too), so its bookkeeping is bounded by the queue.

Log-probs are ``log_softmax(logits / temperature)`` of the sampled token (temperature 0
means greedy and is scored at temperature 1), i.e. the quantity a trainer recomputes at
the same temperature; top-p/top-k truncation changes what is sampled, not the reported
log-prob.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..bridge.hf_config import require_hf_dir
from ..common.protocol import GenRequest, encode_routed_experts
from .precision import Precision, apply_precision
from .weights import WeightError, check_bucket, check_compatible, dequantize_fp8_pairs, read_checkpoint

log = logging.getLogger("sorl_megatron.rollout.engine")
transformers.utils.logging.disable_progress_bar()


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tokenizer_path: str | None = None
    precision: Precision = "fp32"
    fp8_block_size: int = 128
    max_running_requests: int = 32
    context_length: int | None = None
    enable_return_routed_experts: bool = False
    skip_tokenizer_init: bool = False
    random_seed: int = 0
    weight_version: str = "default"


@dataclass
class _Seq:
    """One sequence being decoded."""

    req: GenRequest
    sample: int
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[list[Any]]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    routing: list[np.ndarray] = field(default_factory=list)  # chunks [tokens, layers, k]
    input_logprobs: list[list[Any]] = field(default_factory=list)


class _RouterTap:
    """Forward hooks on the model's own MoE routers, recording top-k expert ids per layer."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.active = False
        self._records: list[torch.Tensor | None] = [None] * len(self.routers)
        for i, m in enumerate(self.routers):
            m.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            if self.active:
                self._records[i] = out[2].to(torch.int32)  # (logits, scores, indices)

        return fn

    @property
    def top_k(self) -> int:
        return int(getattr(self.routers[0], "top_k", 0)) if self.routers else 0

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """``[batch, seq, layers, top_k]`` routing of the last forward."""
        recs = [r.reshape(batch, seq, -1) for r in self._records]  # type: ignore[union-attr]
        self._records = [None] * len(self.routers)
        return torch.stack(recs, dim=2)


def _wants_input_logprobs(req: GenRequest) -> bool:
    return req.return_logprob and req.logprob_start_len >= 0


def _eos_ids(config, tokenizer, gen_config) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None), getattr(gen_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class Engine:
    """Owns model, tokenizer and scheduler thread. ``submit`` and ``call`` return futures."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_path = cfg.model_path
        self.weight_version = cfg.weight_version
        require_hf_dir(cfg.model_path, "rollout model path")
        if cfg.tokenizer_path and not cfg.skip_tokenizer_init:
            require_hf_dir(cfg.tokenizer_path, "rollout tokenizer path", config=False)
        self.hf_config = AutoConfig.from_pretrained(cfg.model_path)
        self.tokenizer = (
            None if cfg.skip_tokenizer_init else AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.model_path)
        )
        try:
            gen_cfg = transformers.GenerationConfig.from_pretrained(cfg.model_path)
        except OSError:
            gen_cfg = None
        self.eos_ids = _eos_ids(self.hf_config, self.tokenizer, gen_cfg)
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self.context_length = cfg.context_length or int(getattr(self.hf_config, "max_position_embeddings", 4096))
        self.state = read_checkpoint(cfg.model_path)
        self._build_model()
        self._generator = torch.Generator().manual_seed(cfg.random_seed)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _live and _aborted (HTTP thread vs scheduler)
        self._live: dict[str, int] = {}  # rid -> requests queued or running with it
        self._aborted: set[str] = set()  # always a subset of _live
        self._in_update = False
        self._dirty = False
        self._pending_version: str | None = None  # applied with the weights at end_update
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._groups: dict[str, tuple[Any, threading.Lock]] = {}  # weight-update groups by name
        self._groups_lock = threading.Lock()
        self.num_waves = 0

    # ----- model -----

    def _build_model(self) -> None:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.hf_config)]
        model = cls.from_pretrained(None, config=self.hf_config, state_dict=self.state, dtype=torch.float32)
        model = apply_precision(model.eval(), self.cfg.precision, self.cfg.fp8_block_size)
        self.model = model
        self.tap = _RouterTap(model)
        self._dirty = False

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: valid token ids are ``[0, vocab_size)``."""
        return int(self.hf_config.vocab_size)

    @property
    def is_moe(self) -> bool:
        return bool(self.tap.routers)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        return (len(self.tap.routers), self.tap.top_k) if self.is_moe else None

    # ----- public API (any thread) -----

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._groups_lock:
            groups = [g for g, _ in self._groups.values() if g is not None]
            self._groups.clear()
        for g in groups:
            g.destroy()
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, req: GenRequest) -> cf.Future:
        with self._lock:
            self._live[req.rid] = self._live.get(req.rid, 0) + 1
        self._queue.put(req)
        return req.future

    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the scheduler thread between waves."""
        fut: cf.Future = cf.Future()
        self._queue.put((fn, fut))
        return fut

    def abort(self, rid: str) -> bool:
        """Stop the queued or running requests with ``rid``; False (and nothing kept) if none."""
        with self._lock:
            if rid not in self._live:
                return False
            self._aborted.add(rid)
            return True

    @property
    def num_tracked_aborts(self) -> int:
        return len(self._aborted)

    def _finish(self, req: GenRequest, result: Any) -> None:
        """Drop ``req``'s abort bookkeeping, then resolve it (a result list or an exception):
        in that order, so whoever reads the answer sees the bookkeeping already gone."""
        with self._lock:
            left = self._live.get(req.rid, 1) - 1
            if left > 0:
                self._live[req.rid] = left
            else:
                self._live.pop(req.rid, None)
                self._aborted.discard(req.rid)
        if not req.future.done():
            if isinstance(result, BaseException):
                req.future.set_exception(result)
            else:
                req.future.set_result(result)

    # ----- weight updates (scheduler thread only, via call) -----

    def update_from_disk(self, model_path: str, weight_version: str | None) -> str:
        new = read_checkpoint(model_path)
        check_compatible(self.state, new, full=True)
        self.state = new
        self._build_model()
        self.model_path = model_path
        self._pending_version = None  # tensors sent before are replaced by the checkpoint
        if weight_version is not None:
            self.weight_version = weight_version
        return f"loaded {len(new)} tensors from {model_path}"

    def begin_update(self) -> str:
        self._in_update = True
        return "weight update begun"

    def update_from_tensors(self, named: dict[str, torch.Tensor], weight_version: str | None) -> str:
        named = dequantize_fp8_pairs(named, self.cfg.fp8_block_size)  # an FP8 export's pairs -> float32
        check_compatible(self.state, named, full=False)
        for k, v in named.items():
            self.state[k] = v.detach().to(torch.float32).clone()
        self._dirty = True
        if weight_version is not None:
            self._pending_version = weight_version
        if not self._in_update:  # older protocol without begin/end: apply at once
            self._apply_pending()
        return f"updated {len(named)} tensors"

    def end_update(self) -> str:
        self._in_update = False
        self._apply_pending()
        return "weight update ended"

    def set_weight_version(self, version: str) -> str:
        """``/update_weight_version``: within begin/end it labels the weights applied at the end."""
        if self._in_update:
            self._pending_version = version
            return f"weight_version {version} takes effect at /end_weight_update"
        self.weight_version = version
        return f"weight_version set to {version}"

    # ----- distributed weight updates (HTTP worker threads; the scheduler keeps generating) -----

    def init_weights_group(self, spec: Any, timeout_s: float) -> str:
        """Join ``spec`` (a ``GroupSpec``) as rank ``rank_offset``; returns once every member has."""
        from ..common.weight_group import WeightGroup

        with self._groups_lock:
            if spec.group_name in self._groups:
                raise WeightError(f"group_name {spec.group_name!r} is already initialized (destroy it first)")
            self._groups[spec.group_name] = (None, threading.Lock())  # reserved while it forms
        try:
            group = WeightGroup(spec, spec.rank_offset, timeout_s)
        except BaseException:
            with self._groups_lock:
                self._groups.pop(spec.group_name, None)
            raise
        with self._groups_lock:
            self._groups[spec.group_name] = (group, self._groups[spec.group_name][1])
        return f"joined weight-update group {spec.group_name!r} as rank {spec.rank_offset} of {spec.world_size}"

    def _group(self, name: str) -> tuple[Any, threading.Lock]:
        with self._groups_lock:
            entry = self._groups.get(name)
        if entry is None or entry[0] is None:
            known = sorted(k for k, v in self._groups.items() if v[0] is not None)
            raise WeightError(
                f"group_name {name!r} is not initialized (call /init_weights_update_group first; "
                f"initialized: {known})"
            )
        return entry

    def receive_bucket(self, spec: Any) -> dict[str, torch.Tensor]:
        """Receive one announced bucket (a ``BucketSpec``) from its group's rank 0.

        The bucket is checked against the served weights before anything is received; a
        broadcast that fails or times out drops the group (the trainer must re-initialize it)
        and leaves the weights unchanged: the tensors are applied only by ``update_from_tensors``.
        """
        group, lock = self._group(spec.group_name)
        check_bucket(self.state, spec.names, spec.dtypes, spec.shapes, self.cfg.fp8_block_size)
        timeout = group.timeout.total_seconds()
        if not lock.acquire(timeout=timeout):
            raise WeightError(f"group {spec.group_name!r} is busy with another bucket for more than {timeout:g} s")
        try:
            tensors = [torch.empty(s, dtype=d) for s, d in zip(spec.shapes, spec.dtypes)]
            try:
                group.broadcast(tensors)
            except Exception:
                self.destroy_weights_group(spec.group_name)
                raise
        finally:
            lock.release()
        return dict(zip(spec.names, tensors))

    def destroy_weights_group(self, name: str) -> str:
        group, _ = self._group(name)
        with self._groups_lock:
            self._groups.pop(name, None)
        group.destroy()
        return f"destroyed weight-update group {name!r}"

    def _apply_pending(self) -> None:
        # The served model and the version it reports change together, between waves.
        if self._dirty:
            self._build_model()
        if self._pending_version is not None:
            self.weight_version, self._pending_version = self._pending_version, None

    # ----- scheduler -----

    def _loop(self) -> None:
        pending: list[GenRequest] = []
        while not self._stop.is_set():
            if not pending:
                item = self._queue.get()
                if item is None:
                    break
                pending.append(item)
            while True:  # drain everything already waiting
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._stop.set()
                    break
                pending.append(item)
            batch: list[GenRequest] = []
            rows = 0
            while pending:
                head = pending[0]
                if isinstance(head, tuple):  # control op: only between waves
                    if batch:
                        break
                    pending.pop(0)
                    self._run_control(*head)
                    continue
                if head.future.cancelled():  # its HTTP client went away while it waited
                    self._finish(pending.pop(0), None)
                    continue
                if batch and (
                    rows + head.params.n > self.cfg.max_running_requests
                    or _wants_input_logprobs(head)
                    or _wants_input_logprobs(batch[0])
                ):
                    break
                batch.append(pending.pop(0))
                rows += head.params.n
            if batch:
                self._run_wave(batch)

    def _run_control(self, fn: Callable[[], Any], fut: cf.Future) -> None:
        try:
            fut.set_result(fn())
        except Exception as exc:  # reported to the caller, never kills the thread
            log.warning("control operation failed: %s", exc)
            fut.set_exception(exc)

    def _run_wave(self, batch: list[GenRequest]) -> None:
        self.num_waves += 1
        version = self.weight_version  # control ops run on this thread: fixed for the wave
        try:
            with torch.inference_mode():
                seqs = self._generate(batch)
            by_req: dict[int, list[_Seq]] = {}
            for s in seqs:
                by_req.setdefault(id(s.req), []).append(s)
            results = {id(req): [self._result(s, version) for s in by_req[id(req)]] for req in batch}
        except Exception as exc:
            if len(batch) > 1:  # find the culprit: each request alone, so only it fails
                log.warning("a wave of %d requests failed (%s: %s); retrying each alone", len(batch),
                            type(exc).__name__, exc)
                for req in batch:
                    self._run_wave([req])
                return
            log.exception("generation failed for request %s", batch[0].rid)
            self._finish(batch[0], exc)
            return
        for req in batch:
            self._finish(req, results[id(req)])

    def _seqs(self, batch: list[GenRequest]) -> list[_Seq]:
        seqs = []
        for req in batch:
            for j in range(req.params.n):
                seed = req.params.sampling_seed
                k = req.sample_offset + j  # sample index within the client's n
                gen = None if seed is None else torch.Generator().manual_seed(seed + k)
                seqs.append(_Seq(req=req, sample=k, generator=gen))
        return seqs

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache, keep: int):
        """Logits of the last ``keep`` positions (1 while decoding)."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits.float()

    def _generate(self, batch: list[GenRequest]) -> list[_Seq]:
        seqs = self._seqs(batch)
        lens = torch.tensor([len(s.req.input_ids) for s in seqs])
        width = int(lens.max())
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding: every row's last token is at -1
            ids[i, width - lens[i] :] = torch.tensor(s.req.input_ids)
        mask = (torch.arange(width)[None, :] >= (width - lens)[:, None]).long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        want_routing = self.is_moe and any(s.req.return_routed_experts for s in seqs)
        # Prompt log-probs: only the positions some row asks for (from its logprob_start_len on).
        keep = max(
            (len(s.req.input_ids) - max(s.req.logprob_start_len, 1) + 1 for s in seqs if _wants_input_logprobs(s.req)),
            default=1,
        )
        self.tap.active = want_routing
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, pos, cache, keep)
        if want_routing:
            routing = self.tap.take(len(seqs), width).numpy()
            for i, s in enumerate(seqs):
                if s.req.return_routed_experts:
                    s.routing.append(routing[i, width - int(lens[i]) :])
        if any(_wants_input_logprobs(s.req) for s in seqs):
            self._input_logprobs(seqs, logits, lens, width)
        last = logits[:, -1]
        temps = torch.tensor([s.req.params.temperature for s in seqs])
        budgets = [min(s.req.params.max_new_tokens, self.context_length - len(s.req.input_ids)) for s in seqs]
        live = list(range(len(seqs)))  # indices into seqs of rows still in the batch
        for s, b in zip(seqs, budgets):
            if b <= 0:
                s.finish = {"type": "length", "length": 0}
        if any(b <= 0 for b in budgets):
            keep = [k for k, i in enumerate(live) if seqs[i].finish is None]
            live, last, mask, pos, temps = self._select(cache, keep, live, last, mask, pos, temps)
        while live:
            tokens, lps = self._sample(last, [seqs[i] for i in live], temps)
            step_tokens = tokens.tolist()
            for k, i in enumerate(live):
                self._append(seqs[i], step_tokens[k], float(lps[k]), last[k], temps[k], budgets[i])
            keep = [k for k, i in enumerate(live) if seqs[i].finish is None]
            if len(keep) < len(live):
                live, last, mask, pos, temps = self._select(cache, keep, live, last, mask, pos, temps)
                tokens = tokens[keep]
            if not live:
                break
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            logits = self._forward(tokens[:, None], mask, pos, cache, keep=1)
            last = logits[:, -1]
            if want_routing:
                routing = self.tap.take(len(live), 1).numpy()
                for k, i in enumerate(live):
                    if seqs[i].req.return_routed_experts:
                        seqs[i].routing.append(routing[k])
        self.tap.active = False
        return seqs

    @staticmethod
    def _select(cache, keep, live, last, mask, pos, temps):
        idx = torch.tensor(keep, dtype=torch.long)
        if keep:
            cache.batch_select_indices(idx)
        return [live[k] for k in keep], last[idx], mask[idx], pos[idx], temps[idx]

    def _input_logprobs(self, seqs: list[_Seq], logits: torch.Tensor, lens: torch.Tensor, width: int) -> None:
        base = width - logits.shape[1]  # absolute position of logits[:, 0]
        for i, s in enumerate(seqs):
            start = s.req.logprob_start_len
            if not _wants_input_logprobs(s.req):
                continue
            t = s.req.params.temperature or 1.0
            off = width - int(lens[i])  # left padding
            toks = torch.tensor(s.req.input_ids)
            first = max(start, 1)  # token j is scored by the logits at position j - 1
            rows = logits[i, off + first - 1 - base : width - 1 - base]
            lp = torch.log_softmax(rows / t, dim=-1).gather(-1, toks[first:, None])[:, 0].tolist()
            values: list[float | None] = ([None] if start == 0 else []) + lp
            s.input_logprobs = [[v, tok, None] for v, tok in zip(values, toks[start:].tolist())]

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq], temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; returns tokens and their log-probs (see module doc)."""
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        # min_new_tokens: stop tokens are not allowed yet.
        for k, s in enumerate(seqs):
            if len(s.out) < s.req.params.min_new_tokens:
                ban = list(s.req.params.stop_token_ids) + ([] if s.req.params.ignore_eos else list(self.eos_ids))
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
    def _truncate(scaled: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        top_k = torch.tensor([s.req.params.top_k for s in seqs])
        top_p = torch.tensor([s.req.params.top_p for s in seqs])
        min_p = torch.tensor([s.req.params.min_p for s in seqs])
        vocab = scaled.shape[-1]
        if bool((top_k >= vocab).all() and (top_p >= 1).all() and (min_p <= 0).all()):
            return scaled
        values, order = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(values, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each rank
        ranks = torch.arange(vocab)[None, :]
        drop = (ranks >= top_k[:, None]) | (before > top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
        drop[:, 0] = False  # the best token always survives
        values = values.masked_fill(drop, float("-inf"))
        return torch.full_like(scaled, float("-inf")).scatter(-1, order, values)

    def _append(self, s: _Seq, tok: int, lp: float, logits: torch.Tensor, temp: torch.Tensor, budget: int) -> None:
        p = s.req.params
        s.out.append(tok)
        s.logprobs.append(lp)
        if s.req.return_logprob and s.req.top_logprobs_num > 0:
            t = float(temp) or 1.0
            top = torch.log_softmax(logits / t, dim=-1).topk(s.req.top_logprobs_num)
            s.top.append([[v, i, None] for v, i in zip(top.values.tolist(), top.indices.tolist())])
        if s.req.rid in self._aborted or s.req.future.cancelled():
            s.finish = {
                "type": "abort",
                "message": "aborted by /abort_request",
                "status_code": 499,
                "err_type": "Abort",
            }
        elif tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            if len(s.out) > p.min_new_tokens or tok in p.stop_token_ids:
                s.finish = {"type": "stop", "matched": tok}
        elif p.stop and self.tokenizer is not None:
            width = max(len(x) for x in p.stop) + 1
            tail = self.tokenizer.decode(s.out[-width:], skip_special_tokens=False)
            hit = next((x for x in p.stop if x in tail), None)
            if hit is not None:
                s.finish = {"type": "stop", "matched": hit}
        if s.finish is None and len(s.out) >= budget:
            s.finish = {"type": "length", "length": len(s.out)}

    def _result(self, s: _Seq, version: str) -> dict[str, Any]:
        req, p = s.req, s.req.params
        out, lps, top = list(s.out), list(s.logprobs), list(s.top)
        fr = s.finish or {"type": "length", "length": len(out)}
        matched = fr.get("matched")
        if not p.no_stop_trim and isinstance(matched, int) and out and out[-1] == matched:
            out, lps, top = out[:-1], lps[:-1], top[:-1]
        meta: dict[str, Any] = {
            "id": req.rid if (req.total_n or p.n) == 1 else f"{req.rid}-{s.sample}",
            "finish_reason": fr,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(s.out),
            "cached_tokens": 0,
            "weight_version": version,
            "e2e_latency": time.perf_counter() - req.arrival,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            meta["input_token_logprobs"] = s.input_logprobs
            if req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = top
        if req.return_routed_experts and s.routing:
            full = np.concatenate(s.routing, axis=0)
            n_fed = len(req.input_ids) + len(s.out) - 1
            meta["routed_experts"] = encode_routed_experts(full[req.routed_experts_start_len : n_fed])
        result: dict[str, Any] = {"output_ids": out, "meta_info": meta}
        if self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=p.skip_special_tokens)
            if isinstance(matched, str) and not p.no_stop_trim and matched in text:
                text = text[: text.rfind(matched)]
            result["text"] = text
        return result

    def info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.cfg.tokenizer_path or self.cfg.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "precision": self.cfg.precision,
            "architectures": list(getattr(self.hf_config, "architectures", None) or []),
            "num_hidden_layers": int(self.hf_config.num_hidden_layers),
            "num_moe_layers": len(self.tap.routers),
            "num_experts_per_tok": self.tap.top_k if self.is_moe else None,
            "context_length": self.context_length,
            "eos_token_ids": sorted(self.eos_ids),
            "vocab_size": int(self.hf_config.vocab_size),
        }

