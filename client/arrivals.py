"""The seeds open-loop arrivals (client.engine.send_times_ns) and synthetic inputs are drawn from.

One run seed (`--seed N`, else drawn once at random and recorded in the JSON report) is the root of a
`numpy.random.SeedSequence` tree: a child per model (its synthetic inputs), and under it a child per
load level and worker process (its Poisson arrivals), and one per load level for a sequence model's
lengths. Children are named by explicit spawn keys, not by
`SeedSequence.spawn`'s running counter, so a stream's seed depends on where it is, never on how many
were drawn before. `--processes N --distribution poisson` therefore merges N independent Poisson
streams at rate/N each: a Poisson stream at the total rate.
"""

from __future__ import annotations

import secrets

import numpy as np

# The branches under a model's seed.
_INPUTS = 0
_ARRIVALS = 1
_LENGTHS = 2


def random_seed() -> int:
    """A fresh run seed: small enough to type back as --seed and to survive JSON readers (< 2**53)."""
    return secrets.randbelow(2**48)


def child(seed: np.random.SeedSequence | int, *key: int) -> np.random.SeedSequence:
    """The seed at `key` under `seed` (what `spawn` would give, without its counter)."""
    root = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    return np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, *key), pool_size=root.pool_size)


def inputs_seed(seed: int, model_index: int) -> np.random.SeedSequence:
    """The seed of model `model_index`'s synthetic inputs."""
    return child(seed, model_index, _INPUTS)


def arrivals_seed(seed: int, model_index: int, level_index: int) -> np.random.SeedSequence:
    """The seed of one load level's arrivals on one model; worker i's stream is `child(that, i)`."""
    return child(seed, model_index, _ARRIVALS, level_index)


def lengths_seed(seed: int, model_index: int, level_index: int) -> np.random.SeedSequence:
    """The seed of one load level's sequence lengths on one model (sequence models: client.sequences)."""
    return child(seed, model_index, _LENGTHS, level_index)
