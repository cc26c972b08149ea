import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def random_batch(batch=4, seq=12, scale=0.3, seed=0, adv_scale=1.0):
    """Random multi-turn batch: log-probs, old log-probs, advantages and a turn-structured mask."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, seq, generator=g) < 0.7).long()
    mask[0, :] = 1  # a single-turn row
    if batch > 1:
        mask[1, :] = 0  # an all-masked row
    lp = (-torch.rand(batch, seq, generator=g) * 3).requires_grad_()
    old = lp.detach() + scale * torch.randn(batch, seq, generator=g)
    adv = adv_scale * torch.randn(batch, seq, generator=g)
    return lp, old, adv, mask
