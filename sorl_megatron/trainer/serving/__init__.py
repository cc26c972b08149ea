"""Rank 0's serving side: connections to the rollout servers, the fleet, the embedded servers."""
