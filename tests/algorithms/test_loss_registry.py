"""The registry: a config names its loss once (``PolicyLossConfig.spec``)."""

import pytest

from sorl_megatron.algorithms import POLICY_LOSSES, PolicyLossConfig


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_config_spec_is_the_registered_loss(name):
    assert PolicyLossConfig(name=name).spec is POLICY_LOSSES[name]


def test_config_spec_of_a_name_changed_after_validation_names_the_field():
    cfg = PolicyLossConfig()
    cfg.name = "ppo3"
    with pytest.raises(ValueError, match=r"loss.name: unknown policy loss 'ppo3'; registered: \["):
        _ = cfg.spec
