"""Rollout engines that run outside the trainer's processes."""
