"""The recipe loader: a YAML file with its ``defaults:`` chain and command-line overrides, into
the typed schema of ``config.py``; and the resolved config back to YAML.

A recipe is NeMo-style OmegaConf YAML: an optional ``defaults:`` recipe or list of recipes
(paths relative to the file, ``.yaml`` optional) merged in order, then the file itself, then
dotted command-line overrides (``algorithm.loss.name=so_grpo``, or Hydra's ``+key=value`` /
``++key=value`` as NeMo-RL writes them). The merged tree is checked against the schema before
any process starts: unknown keys (with a did-you-mean), wrong types and bad values are errors
naming the key; a recipe path that is not a file is an error listing the recipes beside it.
A key that moved into a section (:data:`MOVED_KEYS`) is an error naming its new place, in a
recipe file or an override alike: an old key is never read under its old name.
Every error is a ``RecipeError``.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from ...common.typed_config import ConfigError, build_dataclass, to_dict
from .config import RecipeError, TrainConfig

MAX_LISTED = 40  # recipe names a not-found message lists, at most
_MISSING = object()

# Every key that moved, old -> new: a recipe or an override that still gives the old one is an
# error naming the new one (no alias: a key has one name). An old key that is now the name of a
# section (the old value's key moved into it) is the old key only when it holds a value, not a
# mapping: ``rollout.weight_sync=disk`` is, ``rollout.weight_sync.bucket_mb=256`` is not.
MOVED_KEYS: dict[str, str] = {
    # rollout.weight_sync: the transport and its settings (issue 44)
    "rollout.weight_sync": "rollout.weight_sync.transport",
    "rollout.weight_sync_bucket_mb": "rollout.weight_sync.bucket_mb",
    "rollout.weight_sync_timeout_s": "rollout.weight_sync.timeout_s",
    "rollout.weight_sync_init_timeout_s": "rollout.weight_sync.init_timeout_s",
    "rollout.weight_sync_master_address": "rollout.weight_sync.master_address",
    # rollout.fleet: the servers, the router, failover and restarts
    **{f"rollout.{key}": f"rollout.fleet.{key}" for key in (
        "num_servers", "router", "router_url", "router_policy", "router_balance_abs_threshold", "start_timeout_s",
        "failover_retries", "restart_servers", "restart_command")},
    # the rollout modes' keys: the staleness bound the lagged modes share, each mode's own
    "rollout.max_staleness": "rollout.staleness.max",
    "rollout.stale_groups": "rollout.staleness.stale_groups",
    "rollout.lag": "rollout.lagged.lag",
    "rollout.pause_mode": "rollout.async.pause_mode",
    "rollout.flush_idle_timeout_s": "rollout.async.flush_idle_timeout_s",
}


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML recipe with its ``defaults`` chain, apply dotted overrides, validate."""
    from omegaconf import OmegaConf

    tree = _load_with_defaults(Path(path), seen=())
    if overrides:
        added = overrides_tree(overrides)
        _refuse_moved_keys(OmegaConf.to_container(added), _override_names(overrides))
        try:
            tree = OmegaConf.merge(tree, added)
        except Exception as err:  # e.g. a list given for a section (model=[1])
            raise RecipeError(f"overrides {list(overrides)} do not fit {path}: {err}") from None
    try:
        plain = OmegaConf.to_container(tree, resolve=True)
    except Exception as err:  # unresolvable interpolation
        raise RecipeError(f"{path}: {err}") from None
    plain.pop("defaults", None)
    try:
        return build_dataclass(TrainConfig, plain)
    except RecipeError:
        raise
    except ConfigError as err:  # build_dataclass's own: an unknown key, a wrong type, a loss config's value
        raise RecipeError(str(err)) from None


def overrides_tree(overrides: Sequence[str]):
    """Command-line overrides as an OmegaConf tree to merge over a recipe.

    The grammar NeMo-RL's loader takes (Hydra's): ``key=value``, ``+key=value`` (add a key)
    and ``++key=value`` (add or override). Every key this project has is in the typed schema,
    so the three set the key alike and the schema decides whether it exists: an unknown one
    is an error naming it, whichever form added it. Values are YAML (``[a,b]``, ``null``).
    """
    from omegaconf import OmegaConf

    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if key.startswith("~"):
            raise RecipeError(f"override {item!r}: deleting a key (~key) is not supported; set it instead (key=value)")
        name = key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key
        if not sep or not name.strip() or name != name.strip() or name.startswith("+"):
            raise RecipeError(
                f"override {item!r} is not key=value, +key=value or ++key=value (e.g. algorithm.loss.name=so_grpo)"
            )
        dotlist.append(f"{name}={value}")
    try:
        return OmegaConf.from_dotlist(dotlist)
    except Exception as err:  # omegaconf's grammar errors
        raise RecipeError(f"bad override in {list(overrides)}: {err}") from None


def moved_keys(tree: dict) -> list[tuple[str, str, Any]]:
    """``(old, new, value)`` for each key of :data:`MOVED_KEYS` that ``tree`` (a plain nested
    mapping: a recipe file or the overrides) gives under its old name."""
    found = []
    for old, new in MOVED_KEYS.items():
        node: Any = tree
        for part in old.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is _MISSING or (isinstance(node, dict) and new.startswith(old + ".")):
            continue  # absent, or a section now that holds the moved key
        found.append((old, new, node))
    return found


def _refuse_moved_keys(tree: dict, where: Callable[[str], str]) -> None:
    """One line naming each moved key ``tree`` gives and its new place (``where(old)``: the file
    or the override that gives it)."""
    found = moved_keys(tree)
    if not found:
        return
    parts = []
    for old, new, value in found:
        if new.startswith(old + "."):  # a value where a section is now
            shown = "null" if value is None else value
            parts.append(f"{old}={shown} moved to {new}={shown} ({old} is a section now; in {where(old)})")
        else:
            parts.append(f"{old} moved to {new} (in {where(old)})")
    raise RecipeError("; ".join(parts))


def _override_names(overrides: Sequence[str]) -> Callable[[str], str]:
    """``where`` for the overrides: the override that sets a key (or under it), else all of them."""

    def where(key: str) -> str:
        for item in overrides:
            name = item.partition("=")[0].lstrip("+")
            if name == key or name.startswith(key + "."):
                return f"override {item!r}"
        return f"overrides {list(overrides)}"

    return where


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML (written next to each run for reproducibility)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def _load_with_defaults(path: Path, seen: tuple[Path, ...]):
    from omegaconf import ListConfig, OmegaConf

    if path.suffix not in (".yaml", ".yml") and path.name:
        candidate = path.with_name(path.name + ".yaml")  # names may hold dots: sorl_qwen2.5_7b_base
        path = candidate if candidate.is_file() else path
    path = path.resolve()
    if path in seen:
        raise RecipeError(f"recipe defaults form a cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    if not path.is_file():
        where = f" (listed in the defaults of {seen[-1]})" if seen else ""
        raise RecipeError(f"recipe {path} not found{where}{_recipes_nearby(path)}")
    try:
        node = OmegaConf.load(path)
    except Exception as err:
        raise RecipeError(f"{path}: not valid YAML ({err})") from None
    plain = OmegaConf.to_container(node) if node is not None else {}
    if not isinstance(plain, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping")
    _refuse_moved_keys(plain, lambda key: str(path))
    defaults = node.pop("defaults", None) if "defaults" in node else None
    if isinstance(defaults, str):  # NeMo-RL's loader takes one parent as a string
        defaults = [defaults]
    elif defaults is None:
        defaults = []
    elif not isinstance(defaults, ListConfig):
        raise RecipeError(f"{path}: defaults must be a recipe path or a list of them, got {defaults!r}")
    merged = OmegaConf.create({})
    for item in defaults:
        if not isinstance(item, str) or not item.strip():
            raise RecipeError(f"{path}: defaults entries must be recipe paths (non-empty strings), got {item!r}")
        parent = path.parent / item
        yaml = parent.suffix in (".yaml", ".yml") or (parent.name and parent.with_name(parent.name + ".yaml").is_file())
        if not yaml and parent.exists() and not parent.is_dir():
            # a recipe is a YAML file: any other file is not read (its lines would end up in the error)
            raise RecipeError(f"{path}: defaults entry {item!r} is not a recipe (a .yaml or .yml file)")
        merged = OmegaConf.merge(merged, _load_with_defaults(parent, seen + (path,)))
    return OmegaConf.merge(merged, node)


def _recipes_nearby(path: Path) -> str:
    """For a recipe path that is not a file: the closest recipe name, and the recipes (YAML
    files) of the nearest existing directory above it and of its subdirectories, so that a
    typo in ``--config recipes/...`` shows what there is."""
    folder = next((d for d in path.parents if d.is_dir()), None)
    if folder is None:
        return ""
    patterns = ("*.yaml", "*.yml", "*/*.yaml", "*/*.yml")
    found = (p.relative_to(folder) for pattern in patterns for p in folder.glob(pattern) if p.is_file())
    shown = (p for p in found if not any(part.startswith(".") for part in p.parts))
    names = [str(p) for p in sorted(shown, key=lambda p: (len(p.parts), str(p)))]  # the directory's own first
    if not names:
        return f"; {folder} holds no recipes (*.yaml)"
    stems = {_stem(name): name for name in names}  # compared without .yaml: `defaults:` may leave it out
    close = difflib.get_close_matches(_stem(str(path.relative_to(folder))), list(stems), n=1)
    hint = f"; did you mean {folder / stems[close[0]]}?" if close else ""
    more = f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return f"{hint}; the recipes in {folder}: {', '.join(names[:MAX_LISTED])}{more}"


def _stem(name: str) -> str:
    return name.removesuffix(".yaml").removesuffix(".yml")
