"""sorl-megatron: Megatron-core RL for multi-turn MoE agents with off-policy stabilizers."""

__version__ = "0.1.0"
