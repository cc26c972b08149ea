"""The main loop of the torchrun test workers: run JSON-specified cases, report JSON results.

``python WORKER SPEC OUT`` (or under torchrun): SPEC holds ``models_dir``, ``work_dir``,
``cases`` (each with an ``op`` name) and ``timeout_s``; every case runs even if an earlier one
failed, and rank 0 writes one result dict per case (``ok``, ``error``, ``seconds``, the op's
own fields) to OUT, which pytest asserts on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Callable

import torch

from sorl_megatron.bridge import init_distributed


def run_cases(ops: dict[str, Callable[[dict, str, str], dict]], default_timeout_s: int) -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    init_distributed(timeout_s=spec.get("timeout_s", default_timeout_s))
    rank = torch.distributed.get_rank()
    results = []
    for case in spec["cases"]:
        t = time.time()
        try:
            res = ops[case["op"]](case, spec["models_dir"], spec["work_dir"])
            res["ok"] = True
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["case"] = case
        res["seconds"] = round(time.time() - t, 2)
        results.append(res)
        if rank == 0:
            print(json.dumps({k: v for k, v in res.items() if k != "traceback"}, default=str)[:600], flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
