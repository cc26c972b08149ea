"""torch's deprecation FutureWarnings for the collectives megatron-core calls are filtered, and
only those: the filter is checked against torch's own messages (a world of one, gloo)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, warnings
    import torch, torch.distributed as dist
    from sorl_megatron.engine.base import quiet_megatron_collective_deprecations

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)

    def calls():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if os.environ.get("QUIET"):
                quiet_megatron_collective_deprecations()
            dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4))
            warnings.warn("another deprecation", FutureWarning)
        return sorted(str(w.message).split("`")[1] if "`" in str(w.message) else str(w.message) for w in seen)

    print(calls())
    dist.destroy_process_group()
""")


def _run(quiet: bool) -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}", "PORT": str(port), **({"QUIET": "1"} if quiet else {})}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


def test_only_the_two_collective_deprecations_are_filtered():
    assert _run(quiet=False) == ("['another deprecation', 'torch.distributed.all_gather_into_tensor', "
                                 "'torch.distributed.reduce_scatter_tensor']")
    assert _run(quiet=True) == "['another deprecation']"
