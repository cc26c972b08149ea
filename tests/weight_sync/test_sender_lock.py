"""The senders' mutex against tensor-parallel gathers that run asynchronously (NCCL on GPU): a
sender must not hold the mutex while its broadcast waits behind a gather its TP peer, waiting
for that mutex, has not issued. Two TP ranks in threads, each with an export whose gathers
return at once and finish only when the peer has issued the matching one (as NCCL's)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from sorl_megatron.weight_sync.distributed import DistributedSender, StoreMutex


class AsyncGathers:
    """All-gathers of two ranks: issuing returns at once; a rank's k-th gather has run once the
    other rank has issued its k-th."""

    def __init__(self, timeout_s: float):
        self.issued = [0, 0]
        self.cond = threading.Condition()
        self.timeout_s = timeout_s

    def issue(self, rank: int) -> None:
        with self.cond:
            self.issued[rank] += 1
            self.cond.notify_all()

    def wait_stream(self, rank: int) -> None:
        """Every gather ``rank`` issued so far has run (a stream synchronize), else TimeoutError."""
        with self.cond:
            upto = self.issued[rank]
            if not self.cond.wait_for(lambda: self.issued[1 - rank] >= upto, self.timeout_s):
                raise TimeoutError(f"rank {rank}: a gather waits for the peer, which never issues it")


def sender(rank: int, gathers: AsyncGathers, sent: list) -> DistributedSender:
    s = object.__new__(DistributedSender)  # a formed group, without the servers
    s.group_name, s.bytes_sent, s.group = f"g{rank}", 0, object()
    s.client = SimpleNamespace(cfg=SimpleNamespace(urls=("http://server",)))
    s.group_urls, s.generations, s.group_generations = s.client.cfg.urls, (), ()

    async def send_bucket(spec, tensors):  # the broadcast is queued behind the gathers on the stream
        await asyncio.to_thread(gathers.wait_stream, rank)
        sent.append((rank, len(tensors)))

    s._send_bucket = send_bucket
    return s


def export(rank: int, gathers: AsyncGathers, n: int):
    for i in range(n):
        gathers.issue(rank)  # returns before the gather has run
        yield f"t{i}", torch.ones(16)


def run_two_senders(settle: bool) -> tuple[list, list]:
    gathers, store, sent, errors = AsyncGathers(timeout_s=3.0), dist.HashStore(), [], []

    def rank_main(rank: int, bucket_bytes: int) -> None:
        if rank == 1:
            time.sleep(1.0)  # rank 0 reaches its first bucket first
        lock = StoreMutex(store, "lock", timeout_s=10.0)
        hook = (lambda: gathers.wait_stream(rank)) if settle else (lambda: None)
        try:
            asyncio.run(sender(rank, gathers, sent).send(export(rank, gathers, 4), bucket_bytes, lock, settle=hook))
        except Exception as exc:
            errors.append(exc)

    # rank 0 sends two tensors a bucket, rank 1 one: their buckets end at different gathers
    threads = [threading.Thread(target=rank_main, args=(0, 2 * 64)), threading.Thread(target=rank_main, args=(1, 64))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return sent, errors


def test_a_sender_takes_the_lock_only_after_its_gathers_have_run():
    sent, errors = run_two_senders(settle=True)
    assert errors == []
    assert sorted(sent) == [(0, 2), (0, 2), (1, 1), (1, 1), (1, 1), (1, 1)]


def test_without_settling_the_same_senders_deadlock():
    """The order the test above checks is what prevents this (here bounded by the gathers' timeout)."""
    _, errors = run_two_senders(settle=False)
    assert errors and any(isinstance(e, TimeoutError) for e in errors)

