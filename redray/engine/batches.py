"""From examples to global batches: order, collate, placement."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from redray.pipeline import check_batch


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The example order of an epoch: a pure function of (seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def collate_checked(collate, examples: Sequence, exact: bool = False) -> dict[str, np.ndarray]:
    """Runs the user's collate and validates its output."""
    return check_batch(collate(list(examples)), len(examples) if exact else None)


def to_global(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Places a host's rows of a batch as global arrays split along the batch."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def pad_examples(examples: Sequence, size: int) -> list:
    """Pads a short final batch by repeating its last example (outputs are dropped)."""
    examples = list(examples)
    return examples + [examples[-1]] * (size - len(examples))
