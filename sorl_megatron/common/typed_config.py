"""Build typed dataclass configs from plain mappings, with errors that name the key.

One helper for every config in the project (loss configs, trainer recipes): unknown keys
are errors with a did-you-mean, values are checked against the field annotations
(``int``, ``float``, ``bool``, ``str``, ``Optional``, ``Literal``, ``list[...]``,
``dict[str, ...]`` and nested dataclasses), and the dataclass's own ``__post_init__``
validation runs on the result.

A field's key is its name, unless its metadata names another (``field(metadata={"key":
"async"})``): a key that is a Python keyword is spelled ``async`` in YAML and overrides and
``async_`` in code (:func:`config_key`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names the key."""



MAX_KEYS_SHOWN = 10  # unknown keys named in one error
MAX_KEY_CHARS = 40  # of each: a key is not a place for a file's content (a mis-read file's lines)


def _shown(name: str) -> str:
    """A key as an error names it: one line, at most MAX_KEY_CHARS characters."""
    text = repr(name)[1:-1] if not name.isprintable() else name
    return text if len(text) <= MAX_KEY_CHARS else text[:MAX_KEY_CHARS] + "..."


def config_key(f: dataclasses.Field) -> str:
    """The key a dataclass field has in a config (its name, or its metadata's ``key``)."""
    return f.metadata.get("key", f.name)


def build_dataclass(cls: type[T], values: Mapping[str, Any] | None, prefix: str = "") -> T:
    """Instantiate ``cls`` from ``values`` (missing keys take the dataclass defaults)."""
    if values is None:
        values = {}
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        return values  # type: ignore[return-value]
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"{prefix or cls.__name__}: expected a mapping of {cls.__name__} fields, got {type(values).__name__}"
        )
    hints = get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in values if k not in fields]
    if unknown:
        hints_txt = []
        for key in unknown[:MAX_KEYS_SHOWN]:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            name = _shown(_join(prefix, key))
            hints_txt.append(name + (f" (did you mean {_join(prefix, close[0])}?)" if close else ""))
        more = f" and {len(unknown) - MAX_KEYS_SHOWN} more" if len(unknown) > MAX_KEYS_SHOWN else ""
        raise ConfigError(f"unknown config key(s): {', '.join(hints_txt)}{more}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for key, value in values.items():
        name = fields[key].name
        kwargs[name] = _coerce(hints[name], value, _join(prefix, key))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(_qualify(str(err), prefix)) from None


def to_dict(obj: Any) -> Any:
    """Plain nested dict/list view of a (nested) dataclass config."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _qualify(msg: str, prefix: str) -> str:
    """Make a dataclass's own validation message name the full key path.

    Config classes name their fields relative to their usual section ("clip_bias.delta must
    be > 0"); nested under "algorithm.loss" that becomes "algorithm.loss.clip_bias.delta".
    """
    if not prefix or msg.startswith(prefix + ".") or msg.startswith(prefix + ":"):
        return msg
    parts = prefix.split(".")
    for i in range(len(parts)):
        tail = ".".join(parts[i:])
        if msg.startswith(tail + "."):
            return ".".join(parts[:i] + [msg]) if i else msg
    return f"{prefix}: {msg}"


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _coerce(annotation: Any, value: Any, name: str) -> Any:
    origin = get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{name} must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, name)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{name}: {value!r} matches none of {options}")
    if origin is Literal:
        allowed = get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{name}: {value!r} is not one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(annotation):
        return build_dataclass(annotation, value, name)
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {type(value).__name__} {value!r}")
        (item,) = get_args(annotation)[:1] or (Any,)
        return [_coerce(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a mapping, got {type(value).__name__}")
        _, item = get_args(annotation) or (str, Any)
        return {str(k): _coerce(item, v, f"{name}.{k}") for k, v in value.items()}
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    return value
