"""Runs ``sorl_megatron.train.main`` once per argument list in one process (used under
``torchrun --nproc_per_node=2`` by the layout test): each run builds fresh engines, so
megatron's parallel state is re-initialized at each run's layout on the same world, and each
run starts and stops its own embedded servers.

    torchrun --standalone --nproc_per_node=2 tests/trainer/e2e_launch.py SPEC.json
where SPEC.json is a list of argv lists.
"""

import json
import sys


def main(spec: str) -> int:
    from sorl_megatron.train import main as train_main

    with open(spec) as f:
        runs = json.load(f)
    for argv in runs:
        rc = train_main(argv)
        if rc != 0:
            print(f"run {argv} exited with {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
