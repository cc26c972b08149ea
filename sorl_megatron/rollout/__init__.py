"""Rollouts: SGLang-protocol client, embedded CPU server and the search agent loop."""
