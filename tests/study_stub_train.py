"""A stand-in for ``python -m sorl_megatron.train`` in the study's interrupt test: takes its run
directory's lock (inherited from the study), says it started, and waits for a signal.

    python -m tests.study_stub_train --config RECIPE [key=value ...]
"""

import sys
import time
from pathlib import Path

from sorl_megatron.common.run_lock import acquire_run_lock


def main(argv: list[str]) -> int:
    values = dict(a.split("=", 1) for a in argv if "=" in a)
    run_dir = Path(values["logging.dir"]) / values["logging.run_name"]
    with acquire_run_lock(run_dir):  # refused unless the study's lock reached this process
        (run_dir / "stub_started").write_text("started")
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            (run_dir / "stub_interrupted").write_text("interrupted")
            return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
