"""The one bucketing loop: named tensors grouped into size-bounded lists.

Every weight sync sends its tensors in buckets (``weight_sync.distributed`` per broadcast,
``weight_sync.tensor`` per HTTP body) and the bridge exports a model in buckets
(``bridge.weights.iter_hf_weight_buckets``); all of them group here, so a bucket means the
same thing everywhere.

A bucket is one request to a rollout server, which SGLang loads with one call of its model's
``load_weights``. What that call must see together stays in one bucket:

- an FP8 weight and its ``_scale_inv`` (consecutive, as the quantizer yields them);
- the tensors SGLang's loader joins within one call (:data:`FUSED_IN_ONE_CALL`): DeepSeek's
  ``q_a_proj`` and ``kv_a_proj_with_mqa`` of a layer, which it caches until both have come and
  writes as one ``fused_qkv_a_proj_with_mqa`` (their scales likewise); one that comes without the
  other is dropped when the call ends, and the server keeps the old weights. They are not
  consecutive in an export (``q_b_proj`` lies between): the first is held back until the last
  has come, then the group goes into the bucket as one, after the tensors that came between.

tests/weight_sync/test_receiver_rules.py runs SGLang's own loader over every GPU recipe's sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional

import torch

Named = list[tuple[str, torch.Tensor]]

# Groups of name parts SGLang's loader joins within one load_weights call (one request): the
# names of a group differ only in these parts. DeepSeek-V2/V3 with a q LoRA
# (sglang/srt/models/deepseek_common/deepseek_weight_loader.py, 0.5.21).
FUSED_IN_ONE_CALL: tuple[tuple[str, ...], ...] = ((".self_attn.q_a_proj.", ".self_attn.kv_a_proj_with_mqa."),)


def fused_group(name: str) -> Optional[tuple[str, int]]:
    """(key, size) of the group SGLang joins ``name`` into within one call, or None; the names
    of one group share the key. An FP8 scale is not a member: it follows its weight."""
    if name.endswith("_scale_inv"):
        return None
    for parts in FUSED_IN_ONE_CALL:
        for part in parts:
            if part in name:
                return name.replace(part, "\0", 1), len(parts)
    return None


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[Named, bool]]:
    """``(bucket, last)`` pairs: ``named`` in lists of at most ``bucket_bytes`` (a larger tensor,
    or group, alone), ``last`` true for the final one. An FP8 weight and its ``_scale_inv``
    stay together, and so do the members of a group SGLang joins in one call
    (:func:`fused_group`; a group missing a member goes at the end).

    Lazy: a bucket is yielded as soon as the next tensor does not fit, before any further
    tensor is taken from ``named`` (an export's gathers run between the buckets' sends), so
    ``last`` is known without holding two buckets. A held group member waits for the rest of its
    group, no longer.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Named = []
    size = 0
    held: dict[str, Named] = {}  # incomplete groups, by key
    last_name, last_into = None, None  # the previous tensor, and the held group it went to (None: the bucket)

    def add(unit: Named) -> Iterator[tuple[Named, bool]]:
        nonlocal bucket, size
        nbytes = sum(_nbytes(t) for _, t in unit)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket += unit
        size += nbytes

    for name, t in named:
        if last_name is not None and name == f"{last_name}_scale_inv":  # joins its weight, wherever it went
            target = held.get(last_into) if last_into is not None else None
            if target is not None:
                target.append((name, t))
            else:
                bucket.append((name, t))
                size += _nbytes(t)
            last_name = None
            continue
        last_name, last_into = name, None
        group = fused_group(name)
        if group is None:
            yield from add([(name, t)])
            continue
        key, members = group
        held.setdefault(key, []).append((name, t))
        if sum(fused_group(n) is not None for n, _ in held[key]) < members:
            last_into = key
            continue
        yield from add(held.pop(key))
    for unit in held.values():
        yield from add(unit)
    if bucket:
        yield bucket, True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
