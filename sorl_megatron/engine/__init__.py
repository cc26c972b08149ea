"""The Megatron RL engines: the policy (actor / reference) and value (critic) engines, the RL
batch they train on, MiniRL routing replay and resumable engine checkpoints.

Built on ``sorl_megatron.bridge`` (models, weights, layouts) and the algorithm core; the
trainer drives them. ``megatron.core`` is imported inside the functions that use it, here and
in the bridge: the CPU compatibility patches (``bridge/cpu_compat.py``) must be in place
first, and configs (``engine/config.py``) load without it.
"""
