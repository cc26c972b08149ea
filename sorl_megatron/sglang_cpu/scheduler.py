"""The continuous batch of the CPU server and what waits for it: the scheduler thread's state.

One scheduler thread owns the model and runs a *continuous batch*: every iteration it
admits waiting requests (up to ``max_running_requests`` sequences, ``n`` counted), prefills
them together (left-padded, reusing cached prefixes), merges their KV rows into the running
batch, then takes one decode step for every running sequence. A sequence leaves the batch as
soon as it finishes (its KV row is dropped, and stored in the prefix cache), so a request that
arrives mid-generation joins at the next step and may finish before a longer one started
earlier. :class:`Scheduler` holds that state and runs one iteration at a time; the thread, its
queue and the calls from other threads are the engine's (``engine.py``).

Weights: control operations (weight updates, ``/update_weight_version``) run on the
scheduler thread. As in SGLang (whose updates wait for in-flight requests), an update drains
the batch first: requests queued behind it wait, so every token of a request comes from one
set of weights. While generation is paused (``pause``: ``in_place`` or ``retract``) updates
run at once, and the paused requests continue under the new weights after ``resume``: every
output token carries the version of the weights whose logits it was sampled from
(``meta_info.output_token_weight_versions``); ``weight_version`` is that of the last token.
The prefix cache is dropped by ``/flush_cache`` and by every change of the served weights.

Fairness between calls: the server splits a ``/generate`` prompt's ``n`` into parts of at
most ``max_running_requests`` sequences. Only its first part is queued at once; each later
part is held back until the one before it has finished, then queued behind what arrived
meanwhile (still ahead of any control call queued since, as its call was). A small call that
arrives while a large one runs therefore waits for the running rows to free up, not for every
part of the large call, and two large calls alternate parts. Admission is otherwise first come,
first served, and a request that does not fit holds those behind it, so no call is starved.

Isolation: requests are validated by the server before they get here; if a batched step
still fails, each row is tried alone and only the requests whose rows fail get the error.
``abort`` marks only requests that are queued or running (SGLang ignores unknown ids too), so
its bookkeeping is bounded by the queue.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..common.protocol import GenRequest
from . import forward
from .batch import Batch, Seq, Unit
from .model import ServedModel
from .options import EngineConfig
from .sampling import Sampler, abort_reason

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class LiveRequests:
    """Requests queued or running, by rid, and the rids ``/abort_request`` marked (any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # rid -> requests queued or running with it
        self.aborted: set[str] = set()  # always a subset of _live; the scheduler reads it unlocked

    def __contains__(self, rid: str) -> bool:
        with self._lock:
            return rid in self._live

    def __len__(self) -> int:
        """Requests queued or running (each prompt of a batch, and each part of a split ``n``, is one)."""
        with self._lock:
            return sum(self._live.values())

    def add(self, rid: str) -> None:
        with self._lock:
            self._live[rid] = self._live.get(rid, 0) + 1

    def abort(self, rid: str) -> bool:
        with self._lock:
            if rid not in self._live:
                return False
            self.aborted.add(rid)
            return True

    def finish(self, req: GenRequest, result: Any) -> None:
        """Drop ``req``'s abort bookkeeping, then resolve it (a result list or an exception):
        in that order, so whoever reads the answer sees the bookkeeping already gone."""
        with self._lock:
            left = self._live.get(req.rid, 1) - 1
            if left > 0:
                self._live[req.rid] = left
            else:
                self._live.pop(req.rid, None)
                self.aborted.discard(req.rid)
        try:  # the HTTP thread may cancel the future (a client that left) at any moment
            if isinstance(result, BaseException):
                req.future.set_exception(result)
            else:
                req.future.set_result(result)
        except cf.InvalidStateError:
            pass  # already cancelled or resolved: nobody waits for this answer


def run_control(fn: Callable[[], Any], fut: cf.Future) -> None:
    """Run a control call's ``fn`` and resolve its future; one its caller gave up on is not run."""
    if not fut.set_running_or_notify_cancel():
        return  # its caller gave up (--control-timeout-s passed): not run late
    try:
        result = fn()
    except Exception as exc:  # reported to the caller, never kills the thread
        log.warning("control operation failed: %s", exc)
        fut.set_exception(exc)
        return
    fut.set_result(result)


class Scheduler:
    """The scheduler thread's state: the running batch and the sequences retracted from it, the
    requests and control calls waiting (``_pending``), the later parts of split ``n`` held back,
    and each running request's sequences; one iteration at a time (:meth:`iterate`). ``requests``
    is shared with the other threads (:class:`LiveRequests`)."""

    def __init__(self, cfg: EngineConfig, served: ServedModel, sampler: Sampler, requests: LiveRequests):
        self.cfg = cfg
        self.served = served
        self.sampler = sampler
        self.requests = requests
        self._batch = Batch.empty()
        self._pending: deque = deque()  # requests and control calls not started yet
        self._held: dict[int, deque[GenRequest]] = {}  # split id -> later parts of a split n, not queued yet
        self._retracted: list[Seq] = []
        self._left: dict[int, int] = {}  # id(req) -> its sequences not finished yet
        self._seqs_of: dict[int, list[Seq]] = {}
        self.paused: str | None = None  # the pause mode while paused
        self.num_waves = 0  # prefill forwards (admissions)
        self.num_steps = 0  # decode steps
        self.max_batch = 0  # most rows decoded together so far
        self.max_prefill = 0  # most prompts prefilled together so far

    # ----- the scheduler thread's loop -----

    def receive(self, item: Any) -> None:
        """Queue a request or a control call (``("control", fn, future)``) that arrived; a later
        part of a split ``n`` is held until the part before it ends (fairness: the module doc)."""
        if isinstance(item, GenRequest) and item.split is not None and item.sample_offset > 0:
            self._held.setdefault(item.split, deque()).append(item)  # queued when the part before it ends
        else:
            self._pending.append(item)

    def has_work(self) -> bool:
        if self.paused is not None:
            return any(isinstance(i, tuple) for i in self._pending)
        return bool(len(self._batch) or self._retracted or self._pending)

    def iterate(self) -> None:
        """The control calls due, then (unless paused) admission and one decode step. A failure
        here is a bug: the running requests get it, and the scheduler keeps serving."""
        try:
            self._run_controls()
            if self.paused is None:
                self._admit()
                if len(self._batch):
                    self._step()
        except Exception as exc:  # a bug: fail what runs, keep serving
            log.exception("scheduler iteration failed; failing the running requests")
            for req in {id(s.req): s.req for s in self._batch.rows + self._retracted}.values():
                self._fail(req, exc)
            self._batch, self._retracted = Batch.empty(), []

    def close(self, err: Exception) -> None:
        """The thread stops: every request running, queued or held, and every control call
        queued, gets ``err``."""
        for req in {id(s.req): s.req for s in self._batch.rows + self._retracted}.values():
            self._fail(req, err)
        for item in self._pending:
            if isinstance(item, tuple):
                if item[2].set_running_or_notify_cancel():  # a cancelled one has no reader
                    item[2].set_exception(err)
            else:
                self.requests.finish(item, err)
        for parts in self._held.values():
            for req in parts:
                self.requests.finish(req, err)

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
            queued += [r for parts in self._held.values() for r in parts]
            self._held.clear()
            ops = [r for r in self._pending if not isinstance(r, GenRequest)]
            self._pending.clear()
            self._pending.extend(ops)
            seqs = self._batch.rows + self._retracted + [s for r in queued for s in self._new_seqs(r)]
            for s in seqs:
                s.finish = dict(reason)
                self._seq_done(s)
            self._batch, self._retracted = Batch.empty(), []
            return f"paused; aborted {len(seqs)} queued or running sequences"
        if mode == "retract":
            self._retracted += self._batch.rows
            n = len(self._batch)
            self._batch = Batch.empty()
            return f"paused; retracted {n} running sequences"
        return f"paused in place with {len(self._batch)} running sequences"

    def resume(self) -> str:
        """SGLang's ``/continue_generation``."""
        was, self.paused = self.paused, None
        return "continued" if was else "was not paused"

    def flush_cache(self) -> str | None:
        """Drop the prefix cache where the scheduler is idle, as SGLang's (no running requests,
        and none waiting unless generation is paused); None, flushing nothing, where it is not."""
        if len(self._batch) or (self.paused is None and len(self.requests)):
            return None
        n = self.served.prefix_cache.clear()
        return f"flushed {n} prefix-cache entries"

    # ----- control calls -----

    def _run_controls(self) -> None:
        pending = self._pending
        if self.paused is not None:  # while paused, operations run at once, requests wait
            if any(isinstance(i, tuple) for i in pending):
                ops = [i for i in pending if isinstance(i, tuple)]
                reqs = [i for i in pending if not isinstance(i, tuple)]
                pending.clear()
                pending.extend(reqs)
                for _, fn, fut in ops:
                    run_control(fn, fut)
            return
        # otherwise an operation waits for the running requests to finish (requests behind it wait)
        while pending and isinstance(pending[0], tuple) and not len(self._batch) and not self._retracted:
            _, fn, fut = pending.popleft()
            run_control(fn, fut)

    # ----- admission and prefill -----

    def _new_seqs(self, req: GenRequest) -> list[Seq]:
        seqs = []
        budget = min(req.params.max_new_tokens, self.served.context_length - len(req.input_ids))
        for j in range(req.params.n):
            seed = req.params.sampling_seed
            k = req.sample_offset + j  # sample index within the client's n
            gen = None if seed is None else torch.Generator().manual_seed(seed + k)
            seqs.append(Seq(req=req, sample=k, generator=gen, budget=budget))
        self._left[id(req)] = len(seqs)
        self._seqs_of[id(req)] = seqs
        return seqs

    def _admit(self) -> None:
        pending = self._pending
        units: list[Unit] = []
        rows, cap = len(self._batch), self.cfg.max_running_requests
        while self._retracted and (rows < cap or rows == 0):  # retracted sequences first, KV recomputed
            s = self._retracted.pop(0)
            units.append(Unit(list(s.req.input_ids) + s.out, [s], input_lp=False))
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
            if req.rid in self.requests.aborted:
                for s in seqs:
                    s.finish = abort_reason()
                    self._seq_done(s)
                continue
            input_lp = req.return_logprob and req.logprob_start_len >= 0
            units.append(Unit(list(req.input_ids), seqs, input_lp=input_lp))
            rows += len(seqs)
        if not units:
            return
        for u in units:
            forward.lookup(self.served, u)
        # prompt log-probs: a prefill of its own (its logits cost positions x vocab); the deterministic
        # mode prefills the others together batch-invariantly where the model allows (forward.prefill_rowwise)
        together = not self.cfg.deterministic or self.served.rowwise_prefill
        groups = [[u] for u in units if u.input_lp or not together]
        rest = [u for u in units if not u.input_lp and together]
        if rest:
            groups.append(rest)
        for g in groups:
            for new in self._prefill_safe(g):
                self._batch.merge(new)
        self.max_batch = max(self.max_batch, len(self._batch))

    def _prefill_safe(self, group: list[Unit]) -> list[Batch]:
        try:
            if self.cfg.deterministic and len(group) == 1:
                new = forward.prefill_chunked(self.served, group[0])
            elif self.cfg.deterministic:
                new = forward.prefill_rowwise(self.served, group)
            else:
                new = forward.prefill(self.served, group)
            self.num_waves += 1
            self.max_prefill = max(self.max_prefill, len(group))
            return [new]
        except Exception as exc:
            if len(group) > 1:  # find the culprit: each unit alone, so only it fails
                log.warning("a prefill of %d prompts failed (%s: %s); retrying each alone", len(group),
                            type(exc).__name__, exc)
                return [b for u in group for b in self._prefill_safe([u])]
            log.exception("prefill failed for request %s", group[0].seqs[0].req.rid)
            self._fail(group[0].seqs[0].req, exc)
            return []
        finally:
            self.served.tap.active = False

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
        sampler = self.sampler
        try:
            tokens, lps = sampler.sample_rows(b.last, b.rows, temps)
        except Exception as exc:
            self._isolate(exc, lambda k: sampler.sample_rows(b.last[k : k + 1], [b.rows[k]], temps[k : k + 1]))
            return
        toks, lpl = tokens.tolist(), lps.tolist()
        for k, s in enumerate(b.rows):
            sampler.append(s, toks[k], lpl[k], b.last[k], temps[k], b.versions[k], self.requests.aborted)
        finished = [k for k, s in enumerate(b.rows) if s.finish is not None]
        if finished:
            keep = [k for k, s in enumerate(b.rows) if s.finish is None]
            self._leave(finished)
            tokens = tokens[keep]
        if len(b):
            self._feed(tokens)

    def _feed(self, tokens: torch.Tensor) -> None:
        b, served = self._batch, self.served
        want_routing = served.wants_routing(b.rows)
        try:
            kv, mask, last, routing = forward.decode_forward(served, b, tokens, list(range(len(b))), want_routing)
        except Exception as exc:
            before = [s.req for s in b.rows]
            self._isolate(exc, lambda k: forward.decode_forward(served, b, tokens[k : k + 1], [k], want_routing))
            if len(b):  # the culprits left: feed the others again
                alive = {id(s.req) for s in b.rows}
                self._feed(tokens[[k for k, r in enumerate(before) if id(r) in alive]])
            return
        finally:
            served.tap.active = False
        b.kv, b.mask, b.last = kv, mask, last
        b.pos = b.pos + 1
        b.versions = [served.weight_version] * len(b)
        if routing is not None:
            for k, s in enumerate(b.rows):
                if s.req.return_routed_experts:
                    s.routing.append(routing[k : k + 1])
                    s.routing_end += 1
        self.num_steps += 1

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
                forward.store(self.served, b, k)
        gone = set(rows)
        seqs = [b.rows[k] for k in rows]
        b.select([k for k in range(len(b)) if k not in gone])
        for s in seqs:
            self._seq_done(s)

    def _seq_done(self, s: Seq) -> None:
        key = id(s.req)
        if key not in self._left:
            return
        self._left[key] -= 1
        if self._left[key] == 0:
            del self._left[key]
            seqs = self._seqs_of.pop(key)
            self._finish(s.req, [self.sampler.result(x) for x in seqs])

    def _finish(self, req: GenRequest, result: Any) -> None:
        """Answer ``req`` and queue the next part of its split ``n``, if one is held (fairness:
        the module doc), ahead of the control calls queued after it."""
        self.requests.finish(req, result)
        parts = self._held.get(req.split) if req.split is not None else None
        if parts:
            nxt = parts.popleft()
            if not parts:
                del self._held[req.split]
            pending = self._pending
            at = next((k for k, x in enumerate(pending) if not isinstance(x, GenRequest)), len(pending))
            pending.insert(at, nxt)
