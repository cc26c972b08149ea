"""The value checks the recipe schema (``config.py``) shares, and the error they raise.

Each names the recipe key it checks; ``_check_parallelism`` checks the ``parallelism`` section,
which is ``bridge/layout.py``'s ``ParallelLayout`` itself, so its checks cannot be its method.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from urllib.parse import urlsplit

from ...bridge.layout import ParallelLayout
from ...common.typed_config import ConfigError, config_key


class RecipeError(ConfigError):
    """A recipe that cannot be used: a missing or malformed file, a bad override, an unknown
    key, a wrong type or value, a layout that cannot run. The message names the file or key.

    The one error a bad recipe raises (``load_recipe``, the schema, the launch checks); a
    ``ConfigError`` and so a ``ValueError``, which is what callers catch.
    """


def _check_parallelism(p: ParallelLayout, prefix: str = "parallelism") -> None:
    """The recipe's checks of its ``parallelism`` section. The section is bridge/layout.py's
    ``ParallelLayout`` itself (the engines' layout), so they live here, where the keys are
    recipe keys; the rules that need the model are ``launch_checks.py``."""
    for key in ("tp", "pp", "vpp", "ep"):
        _positive_int(f"{prefix}.{key}", getattr(p, key))
    if p.etp is not None:
        _positive_int(f"{prefix}.etp", p.etp)
    if p.vpp > 1 and p.pp == 1:  # the rule of bridge/layout.py validate_layout
        raise RecipeError(f"{prefix}.vpp={p.vpp} needs {prefix}.pp > 1 (interleaving splits pipeline stages)")
    _check_finite(p, prefix)
    for key in ("collective_timeout_s", "rank0_phase_timeout_s"):
        _positive_seconds(f"{prefix}.{key}", getattr(p, key))  # the maxima: bounds.py (a timedelta overflows)
    if p.gpu_memory_gib is not None and not p.gpu_memory_gib > 0:
        raise RecipeError(f"{prefix}.gpu_memory_gib must be > 0, got {p.gpu_memory_gib}")
    if p.planned_world_size is not None:
        _positive_int(f"{prefix}.planned_world_size", p.planned_world_size)
    for key in ("first_stage_layers", "last_stage_layers"):
        if getattr(p, key) is not None:
            _positive_int(f"{prefix}.{key}", getattr(p, key))
            if p.pp == 1:
                raise RecipeError(f"{prefix}.{key}={getattr(p, key)} needs {prefix}.pp > 1 "
                                  "(it sizes the first / last pipeline stage)")


MAX_RUN_NAME_BYTES = 200  # a file name holds 255 bytes; the rest is for suffixes (run_settings.settings_suffix)


def _check_run_name(name: str, prefix: str = "logging") -> None:
    """``logging.run_name`` names one directory: one path component that fits a file name."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or not name.isprintable():
        raise RecipeError(f"{prefix}.run_name must be one path component (no '/', not '.' or '..'), got "
                          f"{name!r}: the run directory is {prefix}.dir/<run_name>")
    if len(name.encode()) > MAX_RUN_NAME_BYTES:
        raise RecipeError(f"{prefix}.run_name is {len(name.encode())} bytes long: it names a directory, whose "
                          f"name a file system holds in 255 bytes, with room for the suffixes added to it (a "
                          f"variant's settings, a study cell's seed): at most {MAX_RUN_NAME_BYTES} bytes")


def _positive_int(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise RecipeError(f"{name} must be >= {minimum}, got {value}")


def _positive_seconds(name: str, value: float) -> None:
    if not value > 0:  # finite already (_check_finite)
        raise RecipeError(f"{name} must be > 0 seconds, got {value}")


def _check_finite(obj: Any, prefix: str) -> None:
    """Every number of a section is finite: YAML reads ``.nan`` / ``.inf`` as floats, and a
    NaN passes every ``<`` / ``>`` range check after this one."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{config_key(f)}"
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, key)
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, float) and not math.isfinite(item):
                raise RecipeError(f"{key if i is None else f'{key}[{i}]'} must be a finite number, got {item}")


def _in_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise RecipeError(f"{key} must be in [{low:g}, {high:g}], got {value}")


def _check_url(key: str, url: str) -> None:
    """An http(s) URL with a host (the rollout / retrieval servers speak HTTP)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError as err:
        raise RecipeError(f"{key}: {url!r} is not a valid URL ({err})") from None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host or any(c.isspace() for c in url):
        raise RecipeError(f"{key}: {url!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:30000")
