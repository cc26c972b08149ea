"""``parallelism.collective_timeout_s`` bounds megatron's sub-groups as well as the default group:
megatron-core 0.16.1 gives the groups it creates ``distributed_timeout_minutes`` (30 by default)
and its expert-data-parallel gloo group no timeout at all (gloo's 30 minutes), so without this a
hung TP, EP or checkpoint collective waits 30 minutes whatever the recipe says."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch.distributed as dist
seen = []
real = dist.new_group
def spy(*args, **kwargs):
    seen.append(kwargs.get("timeout"))
    return real(*args, **kwargs)
dist.new_group = spy
from sorl_megatron.bridge.parallel import init_distributed, init_parallel
from sorl_megatron.bridge.layout import ParallelLayout
init_distributed(timeout_s=77)
init_parallel(ParallelLayout())
print(len(seen), sorted({t.total_seconds() for t in seen if t is not None}), sum(t is None for t in seen))
"""


def test_every_megatron_group_gets_the_recipes_timeout():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    count, rest = line.split(" ", 1)
    timeouts, unset = rest.rsplit(" ", 1)
    assert int(count) > 5 and timeouts == "[77.0]" and unset == "0", line
