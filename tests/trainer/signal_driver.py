"""``python -m sorl_megatron.train`` with one signal sent to the trainer itself at a chosen point
of an RL step (the signal matrix of test_signals.py).

    python tests/trainer/signal_driver.py POINT STEP SIGNAL [train arguments ...]

POINT is one of :data:`POINTS`; the signal (``SIGINT``, ``SIGTERM``, ``SIGKILL``; ``SIGINT2``:
two SIGINTs 0.3 s apart) goes to this process at the first time the run reaches it during RL
step STEP (1-based), as a terminal's Ctrl-C, a scheduler's SIGTERM or the OOM killer would.
The point ``rollout`` is the rollout phase's event loop as it starts, ``generate`` a
``/generate`` call in it, ``health`` inside the health check's event loop.
Prints ``SENT <point> <step>`` on stderr when it fires.

SIGNAL ``SIGINT_SWALLOWED`` is a Ctrl-C that the code it lands in absorbs, as a library may: the
point catches what it raises there (``KeyboardInterrupt``, or the ``CancelledError`` asyncio
turns it into) and goes on; the run must still stop, at its next phase.

SIGNAL ``ENOSPC`` is a full disk instead: from that point on, every shard file the checkpoint
writer (torch.distributed.checkpoint, under megatron's) writes fails with ``OSError(ENOSPC)``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import re
import signal
import sys
import threading
import time

# point -> (module, class, method)
POINTS = {
    "rollout": ("sorl_megatron.trainer.sources.modes", "RolloutSource", "open_groups"),
    "health": ("sorl_megatron.trainer.serving.fleet", "RolloutFleet", "check"),
    "generate": ("sorl_megatron.rollout.client", "RolloutClient", "generate"),
    "old_logprobs": ("sorl_megatron.engine.actor", "PolicyEngine", "compute_logprobs"),
    "update": ("sorl_megatron.engine.actor", "PolicyEngine", "update"),
    "weight_sync": ("sorl_megatron.trainer.serving.weight_push", "WeightPush", "_push"),
    "checkpoint": ("sorl_megatron.trainer.checkpoints", "RunCheckpoints", "save"),
}


def disk_full() -> None:
    import errno

    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    import torch.distributed.checkpoint.filesystem as dcp

    def no_space(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    dcp._write_item = writer._write_item = no_space


def main() -> int:
    point, step, name, *args = sys.argv[1:]
    twice, full, swallow = name == "SIGINT2", name == "ENOSPC", name == "SIGINT_SWALLOWED"
    sig = None if full else getattr(signal, "SIGINT" if twice or swallow else name)
    step = int(step)
    module, cls, method = POINTS[point]
    import importlib

    import sorl_megatron.trainer.rl_loop as rl_loop

    now = {"step": 0, "sent": False}
    set_phase = rl_loop.RLTrainer._set_phase

    def tracking(self, phase: str) -> None:
        found = re.match(r"RL step (\d+) of", phase)
        if found:
            now["step"] = int(found.group(1))
        set_phase(self, phase)

    rl_loop.RLTrainer._set_phase = tracking
    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, method)

    def fire() -> bool:
        if now["sent"] or now["step"] != step:
            return False
        now["sent"] = True
        print(f"SENT {point} {step}", file=sys.stderr, flush=True)
        if full:
            disk_full()
            return True
        # as a terminal does: to the whole process group when the run leads its own (the test starts
        # it so), e.g. the checkpoint writer's helper processes too; else to this process
        group = os.getpgrp() == os.getpid()
        send = (lambda: os.killpg(os.getpgrp(), sig)) if group and sig != signal.SIGKILL else (
            lambda: os.kill(os.getpid(), sig))
        if twice:
            threading.Timer(0.3, send).start()
        send()
        return True

    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapped(*a, **kw):
            if not (threading.current_thread() is threading.main_thread() and swallow):
                if threading.current_thread() is threading.main_thread():
                    fire()
                return await original(*a, **kw)
            try:
                if fire():
                    await asyncio.sleep(0.5)  # the handler runs: asyncio cancels this task, or it raises here
            except (asyncio.CancelledError, KeyboardInterrupt):
                task = asyncio.current_task()
                while task is not None and task.cancelling():  # swallowed whole, as a careless library does
                    task.uncancel()
            return await original(*a, **kw)
    else:
        @functools.wraps(original)
        def wrapped(*a, **kw):
            try:
                if fire() and swallow:
                    time.sleep(0.5)  # the handler runs here
            except KeyboardInterrupt:
                if not swallow:
                    raise
            return original(*a, **kw)

    setattr(owner, method, wrapped)
    import sorl_megatron.train as train

    sys.argv = ["sorl_megatron/train.py", *args]  # the rerun advice names the trainer's own command
    return train.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
