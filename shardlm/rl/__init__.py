"""Online reinforcement learning (GRPO and its variants)."""
