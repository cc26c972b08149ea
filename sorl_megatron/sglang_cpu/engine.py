"""The CPU generation engine behind the SGLang-compatible server: the served model and its
scheduler thread.

One scheduler thread owns the model and runs a *continuous batch* (``scheduler.py``: the batch,
admission, decoding, pause and fairness between calls); this module is the thread, its queue,
and what other threads call: ``submit`` a request, ``call`` a control operation on the thread
(weight updates; ``urgent`` ones, pause / continue / flush, at its next step), ``abort``.

Where the other parts are: the batch, its KV layout and the prefix cache in ``batch.py``; prefill,
decode and prefix-cache lookups in ``forward.py`` (with the deterministic mode); sampling and
answers in ``sampling.py``; the model, its weights and weight updates in ``model.py``;
distributed weight-update groups in ``weight_groups.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..common.protocol import GenRequest
from .model import ServedModel
from .options import EngineConfig
from .sampling import Sampler
from .scheduler import LiveRequests, Scheduler, run_control
from .weight_groups import WeightGroups


class RolloutEngine:
    """Owns the served model and the scheduler thread. ``submit`` and ``call`` return futures;
    weight updates are ``call(lambda: engine.served.update_from_...)``."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.served = ServedModel(cfg)
        self.sampler = Sampler(self.served, cfg.random_seed)
        self.groups = WeightGroups(self.served)
        self.requests = LiveRequests()
        self.scheduler = Scheduler(cfg, self.served, self.sampler, self.requests)  # scheduler thread only
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)

    # ----- public API (any thread) -----

    def start(self) -> RolloutEngine:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs: nothing queued is answered once it has stopped."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self.groups.destroy_all()
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, req: GenRequest) -> cf.Future:
        self.requests.add(req.rid)
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
        return self.requests.abort(rid)

    @property
    def num_tracked_aborts(self) -> int:
        return len(self.requests.aborted)

    @property
    def num_live_requests(self) -> int:
        """Requests queued or running (each prompt of a batch, and each part of a split ``n``, is one)."""
        return len(self.requests)

    def info(self) -> dict[str, Any]:
        cache = self.served.prefix_cache
        return {
            **self.served.info(),
            "paused": self.scheduler.paused,
            "deterministic": self.cfg.deterministic,
            "prefix_cache": {
                "enabled": self.cfg.enable_prefix_cache,
                "entries": len(cache),
                "tokens": cache.tokens,
                "max_tokens": cache.max_tokens,
                "lookups": cache.lookups,
                "hits": cache.hits,
                "hit_tokens": cache.hit_tokens,
            },
        }

    # the scheduler's counters (server_info)

    @property
    def num_waves(self) -> int:
        return self.scheduler.num_waves

    @property
    def num_steps(self) -> int:
        return self.scheduler.num_steps

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def max_prefill(self) -> int:
        return self.scheduler.max_prefill

    # ----- the scheduler thread -----

    def _loop(self) -> None:
        scheduler = self.scheduler
        try:
            while not self._stop.is_set():
                self._take(block=not scheduler.has_work())
                if self._stop.is_set():
                    break
                with torch.inference_mode():
                    scheduler.iterate()
        finally:
            scheduler.close(RuntimeError("the rollout engine stopped"))

    def _take(self, block: bool) -> None:
        """Hand what arrived to the scheduler; urgent operations run at once."""
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
                    run_control(item[1], item[2])
            else:
                self.scheduler.receive(item)
