"""``common/typed_config.py``: a field whose config key differs from its name (a Python keyword)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sorl_megatron.common.typed_config import ConfigError, build_dataclass, to_dict


@dataclass
class _Inner:
    wait_s: float = 1.0


@dataclass
class _Outer:
    async_: _Inner = field(default_factory=_Inner, metadata={"key": "async"})
    plain: int = 0


def test_a_field_keyed_by_a_keyword_is_read_and_written_under_its_key():
    cfg = build_dataclass(_Outer, {"async": {"wait_s": 2}, "plain": 3})
    assert cfg.async_.wait_s == 2.0 and cfg.plain == 3
    assert to_dict(cfg) == {"async": {"wait_s": 2.0}, "plain": 3}


def test_the_field_name_is_not_a_key_and_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): x.async_ \(did you mean x.async\?\); "
                                          r"valid keys: async, plain"):
        build_dataclass(_Outer, {"async_": {}}, "x")
    with pytest.raises(ConfigError, match=r"x.async.wait_s must be a number"):
        build_dataclass(_Outer, {"async": {"wait_s": "soon"}}, "x")
