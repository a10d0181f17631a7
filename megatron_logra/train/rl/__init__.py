"""The RL trainer (``megatron-logra rl``): :mod:`.job` runs a step in four phases, one module
each (rollouts, batching, policy update, evaluation)."""

from megatron_logra.train.rl.job import RLJob, rl

__all__ = ["RLJob", "rl"]
