"""common/comm.py: collectives on the group's device, and rank-0 phases that never leave the
other ranks inside a collective.

No GPU here: which device an NCCL group takes is checked by reading the backend config as
torch reports it for NCCL (``cuda:nccl``), without moving a tensor; ``tools/gpu_check.py`` runs
the real thing on a GPU. The two-rank cases run on gloo in two spawned processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from sorl_megatron.common import comm


def test_an_nccl_group_takes_cuda_tensors(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.group_devices() == ("cuda",)
    assert comm.device_for(torch.zeros(2)) == torch.device("cuda", 3)  # a CPU tensor must move


def test_a_mixed_group_keeps_each_tensor_where_it_is(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert comm.group_devices() == ("cpu", "cuda")
    assert comm.device_for(torch.zeros(2)) == torch.device("cpu")


_WORLD_OF_ONE = """
import torch
from sorl_megatron.common import comm
assert not comm.initialized()
t = torch.ones(3)
assert comm.all_reduce(t) is t and comm.rank() == 0 and comm.world_size() == 1
assert comm.broadcast_object({"a": 1}) == {"a": 1} and comm.all_gather_object(5) == [5]
assert comm.on_rank0(lambda: 7, "a phase", timeout_s=1) == 7
print("ok")
"""


def test_without_a_process_group_everything_is_a_world_of_one():
    # a fresh interpreter: another test file in this process may have left a group up
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _WORLD_OF_ONE], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _worker(rank: int, ports, case: str, out) -> None:
    try:
        import torch.distributed as dist

        # rank 0's store binds a port the system picks and hands it over: no free port to race for
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
            ports.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", ports.get(timeout=120), 2, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        if case == "collectives":
            t = torch.tensor([float(rank + 1)], dtype=torch.float64)
            comm.all_reduce(t, "sum")
            m = comm.all_reduce(torch.tensor([rank]), "max")
            parts = comm.all_gather(torch.tensor([rank, 10 + rank]))
            obj = comm.on_rank0(lambda: {"rows": [1, 2]}, "a test phase", timeout_s=30)
            out.put((rank, "ok", (t.item(), m.item(), [p.tolist() for p in parts], obj, comm.any_rank(rank == 1))))
        elif case == "rank0_fails":
            def fail():
                raise ValueError("no rows")
            try:
                comm.on_rank0(fail, "validation", timeout_s=30)
            except Exception as err:
                out.put((rank, type(err).__name__, str(err)))
        elif case == "rank0_slow":
            import time

            def slow():
                time.sleep(3)
                return 1
            try:
                comm.on_rank0(slow, "the PVPO reference pass", timeout_s=0.5)
                out.put((rank, "ok", None))
            except Exception as err:
                out.put((rank, type(err).__name__, str(err)))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "crash", traceback.format_exc()))


def _two_ranks(case: str) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ports, case, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = out.get(timeout=120)
        results[rank] = tuple(rest)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.slow
def test_two_ranks_on_gloo():
    got = _two_ranks("collectives")
    for rank in (0, 1):
        status, value = got[rank]
        assert status == "ok", value
        assert value == (3.0, 1, [[0, 10], [1, 11]], {"rows": [1, 2]}, True)


@pytest.mark.slow
def test_a_failure_on_rank0_is_named_on_every_rank():
    got = _two_ranks("rank0_fails")
    assert got[0] == ("ValueError", "no rows")
    assert got[1] == ("RankZeroPhaseError", "rank 0 failed in validation: ValueError: no rows")


@pytest.mark.slow
def test_a_waiting_rank_gives_up_naming_the_phase_and_the_setting():
    got = _two_ranks("rank0_slow")
    assert got[1][0] == "RankZeroPhaseError"
    assert "waited 0.5 s for rank 0 to finish the PVPO reference pass" in got[1][1]
    assert "parallelism.rank0_phase_timeout_s" in got[1][1]


def test_the_process_group_takes_the_recipes_timeout():
    """``parallelism.collective_timeout_s`` reaches the default group (init_distributed)."""
    import subprocess
    import sys

    code = ("import torch, torch.distributed as dist\n"
            "from sorl_megatron.bridge.parallel import init_distributed\n"
            "init_distributed(timeout_s=12.5)\n"
            "print(dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu')).options._timeout)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("0:00:12.500000")


def test_a_world_of_one_leaves_no_launch_variables_for_its_children():
    """A world of one passes its store to torch explicitly and writes nothing to os.environ: a
    child it starts (a benchmark, a study cell) must start its own world. When it exported RANK
    and its bound MASTER_PORT, four tests' children failed with EADDRINUSE in a serial run."""
    import subprocess
    import sys

    code = ("import os, torch.distributed as dist\n"
            "from sorl_megatron.bridge.parallel import init_distributed\n"
            "init_distributed()\n"
            "assert dist.get_world_size() == 1 and dist.get_rank() == 0\n"
            "print(sorted(k for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT') "
            "if k in os.environ))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
