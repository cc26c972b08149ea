"""The one bucketing loop: named tensors grouped into size-bounded lists.

Every weight sync sends its tensors in buckets (``weight_sync.distributed`` per broadcast,
``weight_sync.tensor`` per HTTP body) and the bridge exports a model in buckets
(``bridge.weights.iter_hf_weight_buckets``); all of them group here, so a bucket means the
same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Named = list[tuple[str, torch.Tensor]]


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[Named, bool]]:
    """``(bucket, last)`` pairs: ``named`` in lists of at most ``bucket_bytes`` (a larger tensor
    alone), ``last`` true for the final one. An FP8 weight and its ``_scale_inv`` (consecutive,
    as the quantizer yields them) stay together.

    Lazy: a bucket is yielded as soon as the next tensor does not fit, before any further
    tensor is taken from ``named`` (an export's gathers run between the buckets' sends), so
    ``last`` is known without holding two buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Named = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        pair = bucket and name == f"{bucket[-1][0]}_scale_inv"
        if bucket and not pair and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket, True
