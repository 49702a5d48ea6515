"""Rewards as user functions, run here or on Ray workers.

A verifier may be slow (it runs the code a model wrote, calls a service, parses a
proof): ``score(reward, *columns, workers=N)`` splits the rows over ``N`` Ray tasks, each
a process of its own, and returns the rewards in the rows' order. With ``workers=0`` it
calls ``reward`` in this process. On a trainer of several hosts every host calls it
(as with the Trainer): host 0 runs the tasks, the others receive its rewards through
the JAX runtime.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import numpy as np

from redray.processes.jax_runtime import from_process_zero


def _scored(reward: Callable, rows: list, first: int) -> list[float]:
    out = []
    for i, row in enumerate(rows):
        try:
            value = float(reward(*row))
        except Exception as error:  # noqa: BLE001 - named with its row, raised by the caller
            raise RewardError(f"the reward function failed on row {first + i} "
                              f"({_shown(row)}): {type(error).__name__}: {error}") from error
        if not math.isfinite(value):
            raise RewardError(f"the reward function returned {value} for row {first + i} "
                              f"({_shown(row)}): a reward must be a finite number")
        out.append(value)
    return out


class RewardError(ValueError):
    """A reward function failed on a row, or returned what is not a finite number."""


def _shown(row) -> str:
    text = ", ".join(repr(x) for x in row)
    return text if len(text) <= 200 else text[:200] + "..."


def score(reward: Callable[..., float], *columns: Sequence, workers: int = 0,
          task_options: dict | None = None) -> np.ndarray:
    """``reward(*row)`` for every row of ``columns`` (zipped), as a float32 array.

    Args:
      reward: the user's function of one row's values; it must pickle for ``workers``.
      *columns: equally long sequences (e.g. the prompts and their completions).
      workers: Ray tasks to split the rows over (0: in this process).
      task_options: more Ray task options (``num_cpus``, ``resources``).

    Raises:
      RewardError: ``reward`` raised on a row or returned a non-finite value (the
        message names the row).
    """
    lengths = {len(c) for c in columns}
    if len(lengths) > 1:
        raise ValueError(f"score got columns of lengths {sorted(lengths)}: give one value "
                         "per row in each")
    rows = list(zip(*columns))
    if workers < 0:
        raise ValueError(f"workers={workers}: give 0 (here) or more Ray tasks")
    if jax.process_index() == 0:
        if workers == 0 or not rows:
            values = _scored(reward, rows, 0)
        else:
            values = _on_tasks(reward, rows, workers, task_options or {})
        values = np.asarray(values, np.float32)
    else:
        values = np.zeros(len(rows), np.float32)
    return from_process_zero(values)


def _on_tasks(reward, rows: list, workers: int, options: dict) -> list[float]:
    import ray

    from redray.processes.ray_local import ensure_ray

    ensure_ray()
    task = ray.remote(_scored).options(**{"num_cpus": 1, "max_retries": 0, **options})
    cuts = np.linspace(0, len(rows), min(workers, len(rows)) + 1).astype(int)
    reward_ref = ray.put(reward)
    refs = [task.remote(reward_ref, rows[a:b], int(a)) for a, b in zip(cuts[:-1], cuts[1:])]
    try:
        parts = ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, RewardError):  # the row's message, without the task's frames
            raise RewardError(str(cause)) from None
        raise
    return [v for part in parts for v in part]


def messages(completions: Sequence, tokenizer, end_of_turn) -> list[str | None]:
    """The assistant messages a reward reads: each completion (a ``Completion`` or its
    token ids) decoded with the tokenizer, its end-of-turn token and other special tokens
    left out; None for one that no token of ``end_of_turn`` ended (cut at
    ``max_new_tokens``: an unfinished message, which a reward should not take for a
    whole one).

    ``end_of_turn``: the ids the sampler stopped on (a checkpoint's
    ``generation_config.json`` ``eos_token_id``s, as ``Sampler`` reads them).
    """
    stops = set(np.atleast_1d(end_of_turn).tolist())
    out = []
    for c in completions:
        tokens = np.asarray(getattr(c, "tokens", c)).tolist()
        out.append(tokenizer.decode(tokens, skip_special_tokens=True)
                   if tokens and tokens[-1] in stops else None)
    return out
