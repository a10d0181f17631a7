"""Reinforcement-learning pieces of the trainer.

The modules here that do not import Megatron (rewards, advantages, per-token policy losses,
pass@k) are plain Python and torch, so each can be tested on its own against hand-computed values.
"""
