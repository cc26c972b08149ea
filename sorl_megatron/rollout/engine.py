"""CPU generation engine behind the embedded SGLang-compatible server.

One scheduler thread owns the model and runs a *continuous batch*: every iteration it
admits waiting requests (up to ``max_running_requests`` sequences, ``n`` counted), prefills
them together (left-padded, reusing cached prefixes), merges their KV rows into the running
batch, then takes one decode step for every running sequence. A sequence leaves the batch as
soon as it finishes (its KV row is dropped, and stored in the prefix cache), so a request that
arrives mid-generation joins at the next step and may finish before a longer one started
earlier.

KV layout: one ``[rows, kv_heads, width, head_dim]`` tensor pair per layer; a row's tokens
sit at the columns where its attention mask is 1 (left padding, and a padding gap between a
cached prefix and the freshly prefilled suffix). Position ids are kept per row, so RoPE sees
every token at its true position whatever the padding. Leading columns that are padding in
every row are trimmed when sequences leave.

Prefix cache (SGLang's radix cache, flat): a finished sequence's KV (prompt + output but the
last, unfed, token) is stored keyed by its token ids; a later request reuses the KV of its
longest common prefix with any stored sequence (at least one prompt token is always
prefilled) and reports the reused length in ``meta_info.cached_tokens``. The cache holds at
most ``prefix_cache_max_tokens`` tokens (least recently used entries go first), is dropped by
``/flush_cache`` and by every change of the served weights; a sequence whose KV spans a weight
change is not stored.

Weights: control operations (weight updates, ``/update_weight_version``) run on the
scheduler thread. As in SGLang (whose updates wait for in-flight requests), an update drains
the batch first: requests queued behind it wait, so every token of a request comes from one
set of weights. While generation is paused (``pause``: ``in_place`` or ``retract``) updates
run at once, and the paused requests continue under the new weights after ``resume``: every
output token carries the version of the weights whose logits it was sampled from
(``meta_info.output_token_weight_versions``); ``weight_version`` is that of the last token.

Deterministic mode (``deterministic=True``): every sequence is forwarded alone (batch of one,
no padding) and prompts are prefilled in chunks aligned at multiples of
``DETERMINISTIC_CHUNK`` tokens; prefix-cache hits are rounded down to such a multiple and
only the chunk-prefilled part of a sequence is stored. A request with ``sampling_seed`` then
gets the same tokens and log-probs whatever else is in flight and whatever the cache holds.
The cost: decoding rows one by one gives up the batching speed-up (see docs/rollout.md).

Isolation: requests are validated by the server before they get here; if a batched step
still fails, each row is tried alone and only the requests whose rows fail get the error.
A request asking for prompt log-probs is prefilled on its own (its logits cost ``prompt
positions x vocab`` floats). ``abort`` marks only requests that are queued or running
(SGLang ignores unknown ids too), so its bookkeeping is bounded by the queue.

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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoTokenizer, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..bridge.hf_config import require_hf_dir
from ..common.hf_build import HF_BUILD_LOCK
from ..common.protocol import GenRequest, encode_routed_experts
from ..weight_sync.wire import WeightError, check_bucket, check_compatible, dequantize_fp8_pairs, read_checkpoint
from .precision import Precision, apply_precision

log = logging.getLogger("sorl_megatron.rollout.engine")
transformers.utils.logging.disable_progress_bar()

DETERMINISTIC_CHUNK = 32  # prefill chunk (and prefix-cache granularity) of the deterministic mode
PAUSE_MODES = ("abort", "retract", "in_place")
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [rows, kv_heads, width, head_dim]


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
    enable_prefix_cache: bool = True
    prefix_cache_max_tokens: int = 1 << 16
    deterministic: bool = False


@dataclass
class _Seq:
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
class _Unit:
    """Tokens prefilled once for ``seqs`` (a request's n samples, or one retracted sequence)."""

    tokens: list[int]
    seqs: list[_Seq]
    input_lp: bool
    hit: int = 0
    entry: _Entry | None = None


@dataclass
class _Entry:
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
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
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

    def match(self, ids: np.ndarray) -> tuple[_Entry | None, int]:
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
        self._entries[self._next] = _Entry(self._next, ids, kv, routing)
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= len(self._entries.pop(key).ids)


class _RouterTap:
    """Forward hooks on the model's own MoE routers, recording top-k expert ids per layer.

    As SGLang's capture buffer, the routing has one row per decoder layer; dense layers
    (DeepSeek-V3 / GLM-4.5's leading ones) are never routed and read -1."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        # Qwen/Mixtral name theirs *TopKRouter, DeepSeek-V3 / GLM-4.5 *TopkRouter.
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
        self.routers = [m for _, m in found]
        self.layers = [_layer_index(n) for n, _ in found]
        self.num_layers = num_layers
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

    def take(self, batch: int, seq: int) -> np.ndarray:
        """``[batch, seq, num_layers, top_k]`` routing of the last forward (-1 on dense layers)."""
        out = torch.full((batch, seq, self.num_layers, self.top_k), -1, dtype=torch.int32)
        for layer, r in zip(self.layers, self._records):
            out[:, :, layer] = r.reshape(batch, seq, -1)  # type: ignore[union-attr]
        self._records = [None] * len(self.routers)
        return out.numpy()


def _layer_index(module_name: str) -> int:
    parts = module_name.split(".")
    if "layers" not in parts:
        raise ValueError(f"MoE router {module_name!r} is not inside a decoder layer (model.layers.N)")
    return int(parts[parts.index("layers") + 1])


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


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [extra, 0]
    return F.pad(t, pad)


class _Batch:
    """The running sequences and their KV rows (scheduler thread only)."""

    def __init__(self, rows: list[_Seq], kv: KV | None, mask: torch.Tensor, pos: torch.Tensor,
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
    def empty() -> "_Batch":
        z = torch.zeros(0, dtype=torch.long)
        return _Batch([], None, torch.zeros(0, 0, dtype=torch.long), z, torch.zeros(0, 0), [])

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

    def merge(self, other: "_Batch") -> None:
        if not other.rows:
            return
        if not self.rows:
            self.__dict__.update(other.__dict__)
            return
        w = max(self.width, other.width)
        self.kv = [
            (torch.cat([_pad_left(k1, w, 2), _pad_left(k2, w, 2)]),
             torch.cat([_pad_left(v1, w, 2), _pad_left(v2, w, 2)]))
            for (k1, v1), (k2, v2) in zip(self.kv, other.kv)
        ]
        self.mask = torch.cat([_pad_left(self.mask, w, 1), _pad_left(other.mask, w, 1)])
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])
        self.rows += other.rows
        self.versions += other.versions

    def row_kv(self, r: int) -> KV:
        """Row ``r``'s own KV (its masked-in columns), ``[kv_heads, tokens, head_dim]`` per layer."""
        cols = self.mask[r].bool()
        return [(k[r][:, cols], v[r][:, cols]) for k, v in self.kv]


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
        self.prefix_cache = PrefixCache(cfg.prefix_cache_max_tokens)
        self._gen = 0  # bumped whenever the served weights change
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
        # scheduler state (scheduler thread only)
        self._batch = _Batch.empty()
        self._pending: deque = deque()  # requests and control calls not started yet
        self._retracted: list[_Seq] = []
        self._left: dict[int, int] = {}  # id(req) -> its sequences not finished yet
        self._seqs_of: dict[int, list[_Seq]] = {}
        self.paused: str | None = None  # the pause mode while paused
        self.num_waves = 0  # prefill forwards (admissions)
        self.num_steps = 0  # decode steps
        self.max_batch = 0  # most rows decoded together so far

    # ----- model -----

    def _build_model(self) -> None:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.hf_config)]
        with HF_BUILD_LOCK:
            model = cls.from_pretrained(None, config=self.hf_config, state_dict=self.state, dtype=torch.float32)
        model = apply_precision(model.eval(), self.cfg.precision, self.cfg.fp8_block_size)
        self.model = model
        self.tap = _RouterTap(model, int(self.hf_config.num_hidden_layers))
        self._dirty = False
        self._gen += 1
        self.prefix_cache.clear()  # KV of other weights must not be reused

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: valid token ids are ``[0, vocab_size)``."""
        return int(self.hf_config.vocab_size)

    @property
    def is_moe(self) -> bool:
        return bool(self.tap.routers)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        return (self.tap.num_layers, self.tap.top_k) if self.is_moe else None

    # ----- public API (any thread) -----

    def start(self) -> "Engine":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs: nothing queued is answered once it has stopped."""
        return self._thread.is_alive()

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

    def call(self, fn: Callable[[], Any], urgent: bool = False) -> cf.Future:
        """Run ``fn`` on the scheduler thread: between decode steps once the running requests
        have finished (weight updates; at once while paused), or, ``urgent``, at the next step."""
        fut: cf.Future = cf.Future()
        self._queue.put(("urgent" if urgent else "control", fn, fut))
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

    @property
    def num_live_requests(self) -> int:
        """Requests queued or running (each prompt of a batch, and each part of a split ``n``, is one)."""
        with self._lock:
            return sum(self._live.values())

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
        try:  # the HTTP thread may cancel the future (a client that left) at any moment
            if isinstance(result, BaseException):
                req.future.set_exception(result)
            else:
                req.future.set_result(result)
        except cf.InvalidStateError:
            pass  # already cancelled or resolved: nobody waits for this answer

    # ----- pause / continue / flush (scheduler thread, via call(urgent=True)) -----

    def pause(self, mode: str = "abort") -> str:
        """SGLang's ``/pause_generation``: ``abort`` ends every queued and running request (finish
        reason abort) and pauses; ``in_place`` stops decoding, running requests keep their KV;
        ``retract`` stops decoding and drops the running requests' KV, recomputed on continue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            reason = {"type": "abort", "message": "aborted by /pause_generation", "status_code": 499,
                      "err_type": "Abort"}
            queued = [r for r in self._pending if isinstance(r, GenRequest)]
            ops = [r for r in self._pending if not isinstance(r, GenRequest)]
            self._pending.clear()
            self._pending.extend(ops)
            seqs = self._batch.rows + self._retracted + [s for r in queued for s in self._new_seqs(r)]
            for s in seqs:
                s.finish = dict(reason)
                self._seq_done(s)
            self._batch, self._retracted = _Batch.empty(), []
            return f"paused; aborted {len(seqs)} queued or running sequences"
        if mode == "retract":
            self._retracted += self._batch.rows
            n = len(self._batch)
            self._batch = _Batch.empty()
            return f"paused; retracted {n} running sequences"
        return f"paused in place with {len(self._batch)} running sequences"

    def resume(self) -> str:
        """SGLang's ``/continue_generation``."""
        was, self.paused = self.paused, None
        return "continued" if was else "was not paused"

    def flush_cache(self) -> str:
        n = self.prefix_cache.clear()
        return f"flushed {n} prefix-cache entries"

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
        from ..weight_sync.group import WeightGroup

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
        # The served model and the version it reports change together, between decode steps.
        if self._dirty:
            self._build_model()
        if self._pending_version is not None:
            self.weight_version, self._pending_version = self._pending_version, None

    # ----- scheduler -----

    def _loop(self) -> None:
        pending = self._pending
        try:
            while not self._stop.is_set():
                self._take(pending, block=not self._has_work(pending))
                if self._stop.is_set():
                    break
                with torch.inference_mode():
                    try:
                        self._run_controls(pending)
                        if self.paused is None:
                            self._admit(pending)
                            if len(self._batch):
                                self._step()
                    except Exception as exc:  # a bug: fail what runs, keep serving
                        log.exception("scheduler iteration failed; failing the running requests")
                        for req in {id(s.req): s.req for s in self._batch.rows + self._retracted}.values():
                            self._fail(req, exc)
                        self._batch, self._retracted = _Batch.empty(), []
        finally:
            err = RuntimeError("the rollout engine stopped")
            for req in {id(s.req): s.req for s in self._batch.rows + self._retracted}.values():
                self._fail(req, err)
            for item in pending:
                if isinstance(item, tuple):
                    if item[2].set_running_or_notify_cancel():  # a cancelled one has no reader
                        item[2].set_exception(err)
                else:
                    self._finish(item, err)

    def _has_work(self, pending: deque) -> bool:
        if self.paused is not None:
            return any(isinstance(i, tuple) for i in pending)
        return bool(len(self._batch) or self._retracted or pending)

    def _take(self, pending: deque, block: bool) -> None:
        """Move what arrived into ``pending``; urgent operations run at once."""
        while True:
            try:
                item = self._queue.get() if block else self._queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                self._stop.set()
                return
            if isinstance(item, tuple) and item[0] == "urgent":
                with torch.inference_mode():
                    self._run_control(item[1], item[2])
            else:
                pending.append(item)

    def _run_controls(self, pending: deque) -> None:
        if self.paused is not None:  # while paused, operations run at once, requests wait
            if any(isinstance(i, tuple) for i in pending):
                ops = [i for i in pending if isinstance(i, tuple)]
                reqs = [i for i in pending if not isinstance(i, tuple)]
                pending.clear()
                pending.extend(reqs)
                for _, fn, fut in ops:
                    self._run_control(fn, fut)
            return
        # otherwise an operation waits for the running requests to finish (requests behind it wait)
        while pending and isinstance(pending[0], tuple) and not len(self._batch) and not self._retracted:
            _, fn, fut = pending.popleft()
            self._run_control(fn, fut)

    def _run_control(self, fn: Callable[[], Any], fut: cf.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # its caller gave up (--control-timeout-s passed): not run late
        try:
            result = fn()
        except Exception as exc:  # reported to the caller, never kills the thread
            log.warning("control operation failed: %s", exc)
            fut.set_exception(exc)
            return
        fut.set_result(result)

    # ----- admission and prefill -----

    def _new_seqs(self, req: GenRequest) -> list[_Seq]:
        seqs = []
        budget = min(req.params.max_new_tokens, self.context_length - len(req.input_ids))
        for j in range(req.params.n):
            seed = req.params.sampling_seed
            k = req.sample_offset + j  # sample index within the client's n
            gen = None if seed is None else torch.Generator().manual_seed(seed + k)
            seqs.append(_Seq(req=req, sample=k, generator=gen, budget=budget))
        self._left[id(req)] = len(seqs)
        self._seqs_of[id(req)] = seqs
        return seqs

    def _admit(self, pending: deque) -> None:
        units: list[_Unit] = []
        rows, cap = len(self._batch), self.cfg.max_running_requests
        while self._retracted and (rows < cap or rows == 0):  # retracted sequences first, KV recomputed
            s = self._retracted.pop(0)
            units.append(_Unit(list(s.req.input_ids) + s.out, [s], input_lp=False))
            rows += 1
        while pending and isinstance(pending[0], GenRequest) and not self._retracted:
            req = pending[0]
            if req.future.cancelled():  # its HTTP client went away while it waited
                self._finish(pending.popleft(), None)
                continue
            if rows and rows + req.params.n > cap:
                break
            pending.popleft()
            seqs = self._new_seqs(req)
            if req.rid in self._aborted:
                for s in seqs:
                    s.finish = self._abort_reason()
                    self._seq_done(s)
                continue
            units.append(_Unit(list(req.input_ids), seqs, input_lp=_wants_input_logprobs(req)))
            rows += len(seqs)
        if not units:
            return
        for u in units:
            self._lookup(u)
        if self.cfg.deterministic:
            groups = [[u] for u in units]
        else:  # prompt log-probs: a prefill of its own (its logits cost positions x vocab)
            groups = [[u] for u in units if u.input_lp]
            rest = [u for u in units if not u.input_lp]
            if rest:
                groups.append(rest)
        for g in groups:
            for new in self._prefill_safe(g):
                self._batch.merge(new)
        self.max_batch = max(self.max_batch, len(self._batch))

    @staticmethod
    def _abort_reason() -> dict[str, Any]:
        return {"type": "abort", "message": "aborted by /abort_request", "status_code": 499, "err_type": "Abort"}

    def _lookup(self, u: _Unit) -> None:
        if not self.cfg.enable_prefix_cache or not len(self.prefix_cache):
            return
        entry, common = self.prefix_cache.match(np.asarray(u.tokens, dtype=np.int64))
        if entry is None:
            return
        hit = min(common, len(u.tokens) - 1)  # at least one token is prefilled (its logits are sampled)
        req = u.seqs[0].req
        if u.input_lp:  # prompt log-probs need the logits from position logprob_start_len - 1 on
            hit = min(hit, max(req.logprob_start_len, 1) - 1)
        if req.return_routed_experts and entry.routing is None:  # routing of reused positions unknown
            hit = min(hit, min(s.routing_end if s.routing else req.routed_experts_start_len for s in u.seqs))
        if self.cfg.deterministic:
            hit = hit // DETERMINISTIC_CHUNK * DETERMINISTIC_CHUNK
        if hit > 0:
            u.hit, u.entry = hit, entry
            self.prefix_cache.note_hit(hit)

    def _prefill_safe(self, group: list[_Unit]) -> list[_Batch]:
        try:
            if self.cfg.deterministic:
                return [self._prefill_chunked(group[0])]
            return [self._prefill(group)]
        except Exception as exc:
            if len(group) > 1:  # find the culprit: each unit alone, so only it fails
                log.warning("a prefill of %d prompts failed (%s: %s); retrying each alone", len(group),
                            type(exc).__name__, exc)
                return [b for u in group for b in self._prefill_safe([u])]
            log.exception("prefill failed for request %s", group[0].seqs[0].req.rid)
            self._fail(group[0].seqs[0].req, exc)
            return []
        finally:
            self.tap.active = False

    def _cache(self, kv: KV | None) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if kv is not None:
            for layer, (k, v) in zip(cache.layers, kv):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        return cache

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, kv: KV | None, keep: int):
        """One forward: logits of the last ``keep`` positions and the KV grown by ``ids``."""
        cache = self._cache(kv)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits.float(), [(layer.keys, layer.values) for layer in cache.layers]

    def _wants_routing(self, seqs) -> bool:
        return self.is_moe and any(s.req.return_routed_experts for s in seqs)

    def _prefill(self, units: list[_Unit]) -> _Batch:
        """Prefill ``units`` together: row ``i`` is [pad | cached prefix | pad | suffix]."""
        hits = [u.hit for u in units]
        lens = [len(u.tokens) for u in units]
        sufs = [n - h for n, h in zip(lens, hits)]
        P, S, U = max(hits), max(sufs), len(units)
        ids = torch.full((U, S), self.pad_id, dtype=torch.long)
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
        want_routing = self._wants_routing(s for u in units for s in u.seqs)
        self.tap.active = want_routing
        logits, kv = self._run(ids, mask, pos, kv, keep)
        self.tap.active = False
        routing = self.tap.take(U, S) if want_routing else None
        for i, u in enumerate(units):
            if u.input_lp:
                self._input_logprobs(u, logits[i], keep)
            for s in u.seqs:
                self._prefilled(s, u, None if routing is None else routing[i, S - sufs[i] :])
        self.num_waves += 1
        idx = torch.tensor([i for i, u in enumerate(units) for _ in u.seqs], dtype=torch.long)
        return _Batch(
            rows=[s for u in units for s in u.seqs],
            kv=[(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv],
            mask=mask[idx],
            pos=torch.tensor(lens, dtype=torch.long)[idx],
            last=logits[:, -1].index_select(0, idx),
            versions=[self.weight_version] * len(idx),
        )

    def _prefill_chunked(self, u: _Unit) -> _Batch:
        """Deterministic mode: one unit alone, in chunks ending at multiples of DETERMINISTIC_CHUNK."""
        n, h, C = len(u.tokens), u.hit, DETERMINISTIC_CHUNK
        kv = None if u.entry is None else [(k[None, :, :h], v[None, :, :h]) for k, v in u.entry.kv]
        want_routing = self._wants_routing(u.seqs)
        parts, routes, a = [], [], h
        while a < n:
            b = min((a // C + 1) * C, n)
            self.tap.active = want_routing
            logits, kv = self._run(
                torch.tensor(u.tokens[a:b])[None], torch.ones((1, b), dtype=torch.long),
                torch.arange(a, b)[None], kv, (b - a) if u.input_lp else 1,
            )
            self.tap.active = False
            parts.append(logits[0])
            if want_routing:
                routes.append(self.tap.take(1, b - a)[0])
            a = b
        if u.input_lp:
            self._input_logprobs(u, torch.cat(parts), n - h)
        routing = np.concatenate(routes) if routes else None
        for s in u.seqs:
            self._prefilled(s, u, routing)
            s.storable = n // C * C
        self.num_waves += 1
        m = len(u.seqs)
        return _Batch(
            rows=list(u.seqs),
            kv=[(k.expand(m, -1, -1, -1).contiguous(), v.expand(m, -1, -1, -1).contiguous()) for k, v in kv],
            mask=torch.ones((m, n), dtype=torch.long),
            pos=torch.full((m,), n, dtype=torch.long),
            last=logits[:, -1].expand(m, -1).contiguous(),
            versions=[self.weight_version] * m,
        )

    def _prefilled(self, s: _Seq, u: _Unit, routing: np.ndarray | None) -> None:
        """Bookkeeping of a sequence just prefilled; ``routing`` covers positions [hit, len)."""
        if not s.out and not s.routing:
            s.cached_tokens = u.hit
        s.kv_gen = self._gen
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

    def _input_logprobs(self, u: _Unit, logits: torch.Tensor, keep: int) -> None:
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

    # ----- decoding -----

    def _step(self) -> None:
        """Sample one token for every running row, let finished rows leave, feed the rest."""
        b = self._batch
        done = [k for k, s in enumerate(b.rows) if s.finish is not None]  # e.g. no budget at all
        if done:
            self._leave(done)
        if not len(b):
            return
        temps = b.temps()
        try:
            tokens, lps = self._sample_rows(b.last, b.rows, temps)
        except Exception as exc:
            self._isolate(exc, lambda k: self._sample_rows(b.last[k : k + 1], [b.rows[k]], temps[k : k + 1]))
            return
        toks, lpl = tokens.tolist(), lps.tolist()
        for k, s in enumerate(b.rows):
            self._append(s, toks[k], lpl[k], b.last[k], temps[k], b.versions[k])
        finished = [k for k, s in enumerate(b.rows) if s.finish is not None]
        if finished:
            keep = [k for k, s in enumerate(b.rows) if s.finish is None]
            self._leave(finished)
            tokens = tokens[keep]
        if len(b):
            self._feed(tokens)

    def _feed(self, tokens: torch.Tensor) -> None:
        b = self._batch
        want_routing = self._wants_routing(b.rows)
        try:
            kv, mask, last, routing = self._decode_forward(tokens, list(range(len(b))), want_routing)
        except Exception as exc:
            before = [s.req for s in b.rows]
            self._isolate(exc, lambda k: self._decode_forward(tokens[k : k + 1], [k], want_routing))
            if len(b):  # the culprits left: feed the others again
                alive = {id(s.req) for s in b.rows}
                self._feed(tokens[[k for k, r in enumerate(before) if id(r) in alive]])
            return
        finally:
            self.tap.active = False
        b.kv, b.mask, b.last = kv, mask, last
        b.pos = b.pos + 1
        b.versions = [self.weight_version] * len(b)
        if routing is not None:
            for k, s in enumerate(b.rows):
                if s.req.return_routed_experts:
                    s.routing.append(routing[k : k + 1])
                    s.routing_end += 1
        self.num_steps += 1

    def _decode_forward(self, tokens: torch.Tensor, rows: list[int], want_routing: bool):
        """Feed one token per row of ``rows``; returns (kv, mask, last logits, routing [rows, layers, k])."""
        b = self._batch
        whole = len(rows) == len(b)
        if not self.cfg.deterministic:
            if whole:
                kv, mask, pos = b.kv, b.mask, b.pos
            else:
                idx = torch.tensor(rows, dtype=torch.long)
                kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in b.kv]
                mask, pos = b.mask[idx], b.pos[idx]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], dim=1)
            self.tap.active = want_routing
            logits, kv = self._run(tokens[:, None], mask, pos[:, None], kv, 1)
            self.tap.active = False
            routing = self.tap.take(len(rows), 1)[:, 0] if want_routing else None
            return kv, mask, logits[:, -1], routing
        # deterministic: every row alone on its own columns (the last pos[r] ones: no gaps there)
        width = b.width
        cols: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in b.kv]
        lasts, routes = [], []
        for r, tok in zip(rows, tokens):
            n = int(b.pos[r])
            own = [(k[r : r + 1, :, width - n :], v[r : r + 1, :, width - n :]) for k, v in b.kv]
            self.tap.active = want_routing
            logits, kv = self._run(tok.view(1, 1), torch.ones((1, n + 1), dtype=torch.long), b.pos[r].view(1, 1),
                                   own, 1)
            self.tap.active = False
            for (ks, vs), (k, v) in zip(cols, kv):
                ks.append(k[:, :, -1:])
                vs.append(v[:, :, -1:])
            lasts.append(logits[:, -1])
            if want_routing:
                routes.append(self.tap.take(1, 1)[0])
        routing = np.concatenate(routes) if routes else None
        if not whole:
            return None, None, torch.cat(lasts), routing
        kv = [(torch.cat([k, torch.cat(ks)], dim=2), torch.cat([v, torch.cat(vs)], dim=2))
              for (k, v), (ks, vs) in zip(b.kv, cols)]
        mask = torch.cat([b.mask, torch.ones((len(rows), 1), dtype=b.mask.dtype)], dim=1)
        return kv, mask, torch.cat(lasts), routing

    def _isolate(self, exc: Exception, probe: Callable[[int], Any]) -> None:
        """A batched step failed: try each row alone; the requests whose rows fail get the error."""
        b = self._batch
        bad: dict[int, tuple[GenRequest, Exception]] = {}
        for k, s in enumerate(b.rows):
            try:
                probe(k)
            except Exception as e:
                bad[id(s.req)] = (s.req, e)
        if not bad:  # only fails together: every request of the step gets the error
            bad = {id(s.req): (s.req, exc) for s in b.rows}
        log.warning("a decode step of %d rows failed (%s: %s); failing %d request(s)", len(b), type(exc).__name__,
                    exc, len(bad))
        for req, e in bad.values():
            self._fail(req, e)

    def _fail(self, req: GenRequest, exc: BaseException) -> None:
        b = self._batch
        keep = [k for k, s in enumerate(b.rows) if s.req is not req]
        if len(keep) < len(b):
            b.select(keep)
        self._retracted = [s for s in self._retracted if s.req is not req]
        self._left.pop(id(req), None)
        self._seqs_of.pop(id(req), None)
        self._finish(req, exc)

    def _leave(self, rows: list[int]) -> None:
        b = self._batch
        if self.cfg.enable_prefix_cache:
            for k in rows:
                self._store(k)
        gone = set(rows)
        seqs = [b.rows[k] for k in rows]
        b.select([k for k in range(len(b)) if k not in gone])
        for s in seqs:
            self._seq_done(s)

    def _store(self, k: int) -> None:
        """Put row ``k``'s KV into the prefix cache (only if computed with the weights served now)."""
        b = self._batch
        s = b.rows[k]
        if s.kv_gen != self._gen or b.kv is None:
            return
        n = int(b.pos[k])  # fed positions: prompt + output but the last token
        if self.cfg.deterministic:
            n = min(n, s.storable)
        if n <= 0:
            return
        ids = np.asarray((list(s.req.input_ids) + s.out)[:n], dtype=np.int64)
        kv = [(key[:, :n], val[:, :n]) for key, val in b.row_kv(k)]
        routing = None
        if s.req.return_routed_experts and s.routing and s.routing_from == 0 and s.routing_end >= n:
            routing = np.concatenate(s.routing)[:n]
        self.prefix_cache.insert(ids, kv, routing)

    def _seq_done(self, s: _Seq) -> None:
        key = id(s.req)
        if key not in self._left:
            return
        self._left[key] -= 1
        if self._left[key] == 0:
            del self._left[key]
            seqs = self._seqs_of.pop(key)
            self._finish(s.req, [self._result(x) for x in seqs])

    def _sample_rows(self, logits: torch.Tensor, seqs: list[_Seq], temps: torch.Tensor):
        if self.cfg.deterministic and len(seqs) > 1:  # row by row: nothing depends on the batch
            outs = [self._sample(logits[k : k + 1], [s], temps[k : k + 1]) for k, s in enumerate(seqs)]
            return torch.cat([t for t, _ in outs]), torch.cat([lp for _, lp in outs])
        return self._sample(logits, seqs, temps)

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

    def _append(self, s: _Seq, tok: int, lp: float, logits: torch.Tensor, temp: torch.Tensor, version: str) -> None:
        p = s.req.params
        s.out.append(tok)
        s.logprobs.append(lp)
        s.versions.append(version)
        if s.req.return_logprob and s.req.top_logprobs_num > 0:
            t = float(temp) or 1.0
            top = torch.log_softmax(logits / t, dim=-1).topk(s.req.top_logprobs_num)
            s.top.append([[v, i, None] for v, i in zip(top.values.tolist(), top.indices.tolist())])
        if s.req.rid in self._aborted or s.req.future.cancelled():
            s.finish = self._abort_reason()
        elif tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            if len(s.out) > p.min_new_tokens or tok in p.stop_token_ids:
                s.finish = {"type": "stop", "matched": tok}
        elif p.stop and self.tokenizer is not None:
            width = max(len(x) for x in p.stop) + 1
            tail = self.tokenizer.decode(s.out[-width:], skip_special_tokens=False)
            hit = next((x for x in p.stop if x in tail), None)
            if hit is not None:
                s.finish = {"type": "stop", "matched": hit}
        if s.finish is None and len(s.out) >= s.budget:
            s.finish = {"type": "length", "length": len(s.out)}

    def _result(self, s: _Seq) -> dict[str, Any]:
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
            "weight_version": s.versions[-1] if s.versions else self.weight_version,
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
            "routed_experts_layers": self.tap.num_layers if self.is_moe else None,
            "num_experts_per_tok": self.tap.top_k if self.is_moe else None,
            "context_length": self.context_length,
            "eos_token_ids": sorted(self.eos_ids),
            "vocab_size": int(self.hf_config.vocab_size),
            "paused": self.paused,
            "deterministic": self.cfg.deterministic,
            "prefix_cache": {
                "enabled": self.cfg.enable_prefix_cache,
                "entries": len(self.prefix_cache),
                "tokens": self.prefix_cache.tokens,
                "max_tokens": self.prefix_cache.max_tokens,
                "lookups": self.prefix_cache.lookups,
                "hits": self.prefix_cache.hits,
                "hit_tokens": self.prefix_cache.hit_tokens,
            },
        }

