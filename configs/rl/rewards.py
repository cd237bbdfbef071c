"""Rewards of the RL example (configs/rl): a completion is the sum of the prompt's two numbers,
then a newline (the job's stop string)."""


def exact(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion is the answer (surrounding whitespace aside), else 0.0."""
    return 1.0 if completion.strip() == answer else 0.0


def random_reward(prompt: str, completion: str, answer: str) -> float:
    """A reward that ignores the completion (0 or 1 from a hash of both strings): a job trained on
    it must not learn the task, the control of the example."""
    import hashlib

    return float(hashlib.sha256((prompt + "\0" + completion).encode()).digest()[0] & 1)


def digits(prompt: str, completion: str, answer: str) -> float:
    """The share of the completion's characters (the stop string aside) that are digits: the first
    thing the sum task needs, and one a randomly initialised model finds by sampling (10 of its 256
    bytes), so GRPO learns it from scratch in a few steps (configs/rl/fast)."""
    text = completion.removesuffix("\n")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
