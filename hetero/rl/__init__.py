"""Reinforcement-learning post-training (``hetero rl``): the job file, rewards, the GRPO loss,
generation, and the runtime that places rollout and training on device groups.

Submodules are imported where used; this package imports nothing heavy on its own.
"""
