"""The RL trainer on top of the engine, rollout and algorithm packages: recipe schema,
RL loop, SFT cold start, PVPO, logging."""
