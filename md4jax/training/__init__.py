"""Training: the objective, the train state and optimizer, the train step and loop, checkpoints."""
