"""Every registered loss against frozen numbers: loss, gradient and metrics on fixed batches.

``data/policy_loss_frozen.json`` holds what ``compute_policy_loss`` gave for the cases below
(the losses that predate the staged loss were frozen before it); a change of the loss math
shows here as a changed number. A new loss adds its own numbers once its paper check passes:
``python tests/algorithms/test_policy_loss_frozen.py NAME`` writes the numbers of ``NAME``
and keeps the others.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from sorl_megatron.algorithms import POLICY_LOSSES, ISCorrectionConfig, PolicyLossConfig, compute_policy_loss

FROZEN = Path(__file__).parent / "data" / "policy_loss_frozen.json"

CASES = {
    "plain": {"loss_agg": "token-mean"},
    "options": {"loss_agg": "seq-mean-token-mean", "dual_clip": 3.0, "kl_coef": 0.1, "entropy_coef": 0.01,
                "eps_low": 0.1, "eps_high": 0.28,
                "is_correction": {"mode": "tis", "level": "turn", "geometric": False}},
    "diagnostics": {"loss_agg": "seq-mean-token-sum", "diagnostics": True,
                    "is_correction": {"mode": "mis", "low": 0.8, "high": 1.2}},
}


def _batch():
    g = torch.Generator().manual_seed(21)
    B, T = 4, 10
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    mask[0], mask[1] = 1, 0  # a full row and an empty one
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.4 * torch.randn(B, T, generator=g) + torch.tensor([0.3, 0.0, -0.5, 0.2]).unsqueeze(1)
    adv = torch.randn(B, T, generator=g)
    extra = {"rollout_logprobs": old + 0.1 * torch.randn(B, T, generator=g), "ref_logprobs": old - 0.05,
             "entropy": torch.rand(B, T, generator=g)}
    return lp, old, adv, mask, extra


def _numbers(name: str, case: str) -> dict[str, list[float]]:
    lp, old, adv, mask, extra = _batch()
    values = dict(CASES[case])
    if "is_correction" in values:
        values["is_correction"] = ISCorrectionConfig(**values["is_correction"])
    x = lp.clone().requires_grad_()
    loss, metrics = compute_policy_loss(x, old, adv, mask, PolicyLossConfig(name=name, **values), **extra)
    (grad,) = torch.autograd.grad(loss, x)
    out = {"loss": loss, "grad": grad, **{f"metrics/{k}": v for k, v in sorted(metrics.items())}}
    return {key: [float(f"{v:.9g}") for v in t.detach().reshape(-1).tolist()] for key, t in out.items()}


def _frozen() -> dict[str, dict[str, dict[str, list[float]]]]:
    """``{loss: {case: {key: values}}}`` from the file's ``"loss/case"`` lines."""
    frozen: dict = {}
    for key, numbers in json.loads(FROZEN.read_text()).items():
        name, case = key.split("/")
        frozen.setdefault(name, {})[case] = numbers
    return frozen


def test_every_registered_loss_has_frozen_numbers():
    assert set(_frozen()) == set(POLICY_LOSSES)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_loss_gradient_and_metrics_equal_the_frozen_numbers(name, case):
    want = _frozen()[name][case]
    got = _numbers(name, case)
    assert got.keys() == want.keys()
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-5, abs=1e-7), key


def _write(names: list[str]) -> None:
    frozen = _frozen() if FROZEN.exists() else {}
    for name in names:
        frozen[name] = {case: _numbers(name, case) for case in CASES}
    lines = [
        f"  {json.dumps(f'{name}/{case}')}: {json.dumps(numbers, sort_keys=True)}"
        for name in sorted(frozen) for case, numbers in sorted(frozen[name].items())
    ]
    FROZEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the frozen numbers of registered losses (others are kept).")
    parser.add_argument("names", nargs="*", help="registered loss names (default: every registered loss)")
    _write(parser.parse_args().names or sorted(POLICY_LOSSES))
