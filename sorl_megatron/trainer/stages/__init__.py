"""What runs before or beside the RL steps: the SFT cold start and PVPO's reference pass."""
