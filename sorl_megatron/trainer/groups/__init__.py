"""Group bookkeeping: prompt groups, the rollout phase's episodes and their scores."""
