"""Post-training with rewards and preferences: GRPO-family policy updates and VRPO."""
