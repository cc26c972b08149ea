"""The trainer's end of SGLang's distributed weight update against SGLang's own code, on CPU.

SGLang's server side runs in a second process: its ``init_custom_process_group`` (from
``sglang/srt/utils/common.py``) joins the trainer's :class:`WeightGroup` as rank 1 over gloo,
and its ``WeightUpdater.receive_weights_from_distributed`` (from
``sglang/srt/model_executor/model_runner_components/weight_updater.py``) receives one bucket.
Both are SGLang's source as released in the wheel that ``requirements-sglang.txt`` pins
(tests/sglang_wheel.py fetches it into a cache), compiled from the wheel at test time.

Importing those modules whole is not possible on CPU (they import SGLang's GPU-only
dependencies), so each function is taken out of its module with ``ast`` and executed with the
only module-level names it reads supplied: ``torch`` (both) and ``torch_release`` (common.py
computes it from ``torch.__version__`` in the same way). Nothing else is stubbed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from sorl_megatron.weight_sync.group import BucketSpec, GroupSpec, WeightGroup
from tests import sglang_wheel

pytestmark = pytest.mark.slow

COMMON = "sglang/srt/utils/common.py"
UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"

# SGLang's server side: join as rank 1, receive one bucket, print what arrived.
SERVER = textwrap.dedent('''
    import __future__, json, sys
    from datetime import timedelta
    from types import SimpleNamespace
    import torch
    from packaging import version as pkg_version

    spec = json.loads(sys.argv[1])
    ns = {"torch": torch, "torch_release": pkg_version.parse(torch.__version__).release}
    for src in spec["sources"]:
        exec(compile(src, "<sglang>", "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    pg = ns["init_custom_process_group"](
        backend="gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", world_size=2, rank=1,
        group_name=spec["group_name"], timeout=timedelta(seconds=spec["timeout_s"]))
    updater = SimpleNamespace(_model_update_group={spec["group_name"]: pg}, device="cpu")
    b = spec["bucket"]
    got = ns["receive_weights_from_distributed"](updater, names=b["names"], dtypes=b["dtypes"],
                                                 shapes=b["shapes"], group_name=b["group_name"])
    print(json.dumps({n: t.float().flatten().tolist() for n, t in got}))
''')


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(4, 3, generator=g)),
        ("model.layers.0.mlp.gate.weight", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=g).to(torch.float16)),
    ]


def test_sglang_joins_the_trainers_group_and_receives_a_bucket():
    from torch.distributed import TCPStore

    sources = [sglang_wheel.function_source(sglang_wheel.source(COMMON), "init_custom_process_group"),
               sglang_wheel.function_source(sglang_wheel.source(UPDATER), "receive_weights_from_distributed",
                                            cls="WeightUpdater")]
    timeout_s = 20.0
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    spec = GroupSpec("127.0.0.1", int(store.port), 1, 2, "sorl_wsync_r0", "gloo")
    named = _tensors()
    bucket = BucketSpec.of(named, spec.group_name).to_json()
    arg = json.dumps({"sources": sources, "port": spec.master_port, "group_name": spec.group_name,
                      "timeout_s": timeout_s, "bucket": bucket})
    server = subprocess.Popen([sys.executable, "-c", SERVER, arg], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        group = WeightGroup(spec, 0, timeout_s, store)
        group.broadcast([t for _, t in named])
        out, err = server.communicate(timeout=timeout_s + 30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert list(got) == [n for n, _ in named]
    for n, t in named:
        assert got[n] == t.float().flatten().tolist(), n
    group.destroy()


def test_request_bodies_are_sglangs_request_types():
    """The trainer's JSON bodies have every field SGLang's request types require and none they lack."""
    src = sglang_wheel.source(IO_STRUCT)
    bodies = {
        "InitWeightsUpdateGroupReqInput": [GroupSpec("10.0.0.1", 29500, 1, 3, "g", "nccl").to_json()],
        "UpdateWeightsFromDistributedReqInput": [
            BucketSpec.of(_tensors(), "g").to_json(),
            BucketSpec.of(_tensors(), "g", flush_cache=False, weight_version="step_3").to_json(),
        ],
    }
    for cls, examples in bodies.items():
        fields, required = sglang_wheel.struct_fields(src, cls)
        assert required, cls  # the parse found the class's fields
        for body in examples:
            assert set(body) <= fields, (cls, sorted(set(body) - fields))
            assert required <= set(body), (cls, sorted(required - set(body)))


def test_sglang_pins_the_trainers_torch():
    """NCCL joins only peers of its own build: the servers' torch must be the trainer's."""
    torch_pin = sglang_wheel.trainer_torch()
    assert sglang_wheel.pins()["torch"] == torch_pin
    requires = [line for line in sglang_wheel.metadata().splitlines() if line.startswith("Requires-Dist: torch==")]
    assert requires == [f"Requires-Dist: torch=={torch_pin}"]
