"""Whether TransformerEngine's torch extension imports in this process, and why not.

One probe for the layer spec, FP8 and the megatron patches. On a CUDA host a failed import is
said once, with its cause (TE absent, or a build that does not load against this torch), since the
run then takes the local layer spec instead of TE's: slower, and no FP8 training.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Optional

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def te_import_error() -> Optional[str]:
    """None when ``transformer_engine.pytorch`` imports; else the reason, in one line."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, an undefined symbol, the PyPI meta package without its extension
        return f"transformer_engine.pytorch does not import ({type(err).__name__}: {' '.join(str(err).split())})"
    return None


@functools.lru_cache(maxsize=None)
def _warn_once_on_gpu(reason: str) -> None:
    log.warning("TransformerEngine is not used: %s. The local layer spec (torch) runs instead, without FP8 "
                "training; docs/gpu.md gives the install route for the TE path.", reason)


def transformer_engine_available() -> bool:
    """True when TE's torch extension imports (never on a CPU-only host); on a CUDA host a
    failure is logged once, naming its cause."""
    reason = te_import_error()
    if reason is not None:
        import torch

        if torch.cuda.is_available():
            _warn_once_on_gpu(reason)
    return reason is None
