"""The clip-bias statistics (``clip_bias.py``) where the log-ratio clamp cuts the gradient."""

from __future__ import annotations

import torch


def test_the_clip_bias_vector_leaves_out_tokens_past_the_clamp_on_either_path(monkeypatch):
    """``sq_sum`` sums ``c_t^2`` only where ``|log r_t| <= clamp`` (the clamp cuts the gradient
    elsewhere). The CPU skips that masked pass when ``aminmax`` shows no token past the clamp: with
    tokens past it, both paths (host read, and the branch-free one a GPU takes) must drop them."""
    from sorl_megatron.algorithms import aggregation
    from sorl_megatron.algorithms.clip_bias import clip_bias_terms

    clamp = 2.0
    raw = torch.tensor([[0.5, 3.0, -2.5, 0.1], [-0.3, 0.2, 2.0, -1.0]])
    ratio = torch.exp(raw.clamp(-clamp, clamp))
    clipped = torch.ones_like(raw, dtype=torch.bool)
    adv = torch.tensor([[1.0, 2.0, -1.0, 0.5], [1.0, -1.0, 1.0, 2.0]])
    inside = raw.abs() <= clamp
    want = float((((adv * ratio) ** 2) * inside).sum())
    for host in (True, False):
        if not host:
            monkeypatch.setattr(aggregation, "HOST_READ_FREE_DEVICES", ())
        got = clip_bias_terms(ratio, raw, clamp, clipped, adv, None).sq_sum
        assert abs(float(got) - want) < 1e-5, (host, float(got), want)
