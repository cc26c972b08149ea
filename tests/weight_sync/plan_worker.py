"""One torchrun rank of tests/weight_sync/test_sync_plan.py: for each case, the real export of a
small model at a layout (gloo, the bridge's real build on the CPU), as a distributed weight sync
streams it (``export.iter_owned_hf_weights``, the FP8 packing, ``common.buckets``), per rank.

    torchrun --nproc_per_node=4 tests/weight_sync/plan_worker.py CASES_JSON OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main(spec_path: str, out_path: str) -> None:
    from sorl_megatron.bridge.build import build_model
    from sorl_megatron.bridge.layout import ParallelLayout
    from sorl_megatron.bridge.model import ModelOptions
    from sorl_megatron.bridge.parallel import init_distributed
    from sorl_megatron.common.buckets import buckets
    from sorl_megatron.weight_sync.base import fp8_pairs
    from sorl_megatron.weight_sync.export import iter_owned_hf_weights, weight_sync_roles
    from sorl_megatron.weight_sync.plan import config_from_json

    with open(spec_path) as f:
        cases = json.load(f)
    init_distributed("gloo")
    results = []
    for case in cases:
        layout = ParallelLayout.from_string(case["layout"])
        model = build_model(config_from_json(case["config"]), layout,
                            ModelOptions(dtype=torch.bfloat16, use_te=False), load_weights=False)
        roles = weight_sync_roles()
        export = iter_owned_hf_weights(model)
        named = fp8_pairs(export) if case["format"] == "block_fp8" else export
        entries, ends = [], []
        for bucket, _ in buckets(named, case["bucket_bytes"]):
            entries += [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in bucket]
            ends.append(len(entries))
        mine = {"rank": dist.get_rank(), "roles": list(roles), "entries": entries, "bucket_ends": ends}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results.append(every)
        del model
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
