"""Rollouts: SGLang-protocol client, router, the search agent loop and trajectories (the CPU
server is ``sorl_megatron.sglang_cpu``)."""
