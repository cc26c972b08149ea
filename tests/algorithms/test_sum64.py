"""``aggregation.sum64`` / ``count64``: the float64 sums the loss metrics take, bit for bit what
``sum(dtype=torch.float64)`` gives, by cheaper routes on the CPU (cast, then sum; an integer count)."""

from __future__ import annotations

import pytest
import torch

from sorl_megatron.algorithms.aggregation import count64, sum64


@pytest.mark.parametrize("threads", [1, 2])
def test_sum64_is_the_casting_sum_bit_for_bit(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for trial in range(60):
            b, t = (int(x) for x in torch.randint(1, 700, (2,), generator=g))
            x = torch.randn(b, t, generator=g) * float(torch.rand(1, generator=g) * 50)
            if trial % 3 == 0:
                x = torch.exp(x.clamp(-20, 20))  # ratios: positive, wide range
            for v in (x, x[:, ::3], x.t()):
                want = v.sum(dtype=torch.float64)
                got = sum64(v)
                assert got.dtype == torch.float64 and got.item() == want.item(), (trial, b, t)
    finally:
        torch.set_num_threads(old)


def test_count64_is_the_float64_sum_of_a_bool_tensor():
    g = torch.Generator().manual_seed(0)
    for shape in ((0,), (7,), (33, 129), (256, 4096)):
        m = torch.rand(shape, generator=g) < 0.3
        got = count64(m)
        assert got.dtype == torch.float64 and got.item() == m.sum(dtype=torch.float64).item()
