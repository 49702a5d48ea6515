"""What happens at a NaN or inf: the policy, the guard that reads it, the error users see.

The training step itself (``steps.train_step``) never applies a non-finite update and
records the first step that produced one in the state (``TrainState.nonfinite_step``).
Reading that flag is a host sync, so the guard reads it only where ``fit`` syncs
anyway: on the log cadence, at an epoch's end and before every checkpoint is saved.
A checkpoint is therefore never written from a state past a non-finite step.

Policies (``Trainer.of(on_nonfinite=...)``, ``StepSettings.on_nonfinite``):

- ``"stop"`` (default): ``NonFiniteError`` names the step and its batch's position in
  the epoch; the newest checkpoint is the last finite state.
- ``"skip"``: the update of such a step is left out, training goes on; the logged
  metric ``skipped`` is the fraction of a window's steps that were skipped.
- ``"rollback"``: the newest checkpoint's parameters and optimizer state come back and
  training continues with the batch after the one that failed, so the batches between
  that checkpoint and the failure are dropped with it (replaying them would reproduce
  the same state, bit for bit). Step numbers keep counting up (a logged step is never
  reused). After ``MAX_ROLLBACKS`` in one ``fit`` call, it stops as ``"stop"`` does.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from redray.engine.hooks import EpochEnd, Hook, Position, StepInfo

log = logging.getLogger("redray")

MAX_ROLLBACKS = 3


class NonFiniteError(RuntimeError):
    """A training step's loss or gradient norm was NaN or infinite."""


class RolledBack(Exception):
    """The state went back to a checkpoint: ``fit`` restarts its loop from the position."""


class NonFiniteGuard(Hook):
    """Reads the state's ``nonfinite_step`` every ``every`` steps, at an epoch's end and
    before every save (``check``), and stops or rolls back at the first non-finite step.

    Args:
      policy: ``"stop"``, ``"skip"`` (nothing to do here) or ``"rollback"``.
      every: steps between reads (the log cadence: those steps sync already).
      steps_per_epoch: for the position in the message.
      roll_back: the Trainer's ``roll_back``, for the "rollback" policy.
    """

    def __init__(self, policy: str, every: int, steps_per_epoch: int, roll_back):
        self.policy, self.every, self.steps_per_epoch = policy, every, steps_per_epoch
        self.roll_back = roll_back  # Trainer.roll_back, for the "rollback" policy
        self.unchecked: dict[int, StepInfo] = {}
        self.rollbacks = 0

    def on_step(self, run, info: StepInfo) -> None:
        if self.policy == "skip":
            return
        self.unchecked[info.step] = info
        if len(self.unchecked) >= self.every or info.last_of_epoch:
            self.check(run)

    def on_epoch_end(self, run, end: EpochEnd) -> None:
        self.check(run)

    def check(self, run) -> None:
        """Raises ``NonFiniteError`` (or ``RolledBack`` after rolling back) if a step
        since the last check was not finite."""
        if self.policy == "skip" or not self.unchecked:
            return
        bad = run.nonfinite_step
        unchecked, self.unchecked = self.unchecked, {}
        if not bad:
            return
        info = unchecked.get(bad)
        if self.policy == "rollback" and self.rollbacks < MAX_ROLLBACKS and info is not None:
            back_to = self.roll_back(bad, info.position)
            if back_to is not None:
                self.rollbacks += 1
                if jax.process_index() == 0:
                    log.warning("%s; rolled back to the checkpoint of step %d and going on "
                                "with the next batch (rollback %d of at most %d in this fit)",
                                describe(bad, info, self.steps_per_epoch), back_to,
                                self.rollbacks, MAX_ROLLBACKS)
                raise RolledBack()
        raise NonFiniteError(message(run, bad, info, self.steps_per_epoch,
                                     self.rollbacks if self.policy == "rollback" else None))


def describe(step: int, info: StepInfo | None, steps_per_epoch: int | None) -> str:
    """``step 17 (epoch 1, batch 5 of 12) gave a non-finite loss (nan)``."""
    where = f"step {step}"
    if info is not None:
        p: Position = info.position
        of = f" of {steps_per_epoch}" if steps_per_epoch else ""
        where += f" (epoch {p.epoch}, batch {p.batch}{of})"
    what = "loss or gradient norm"
    if info is not None:
        values = {k: float(np.asarray(jax.device_get(info.metrics[k])))
                  for k in ("loss", "grad_norm") if k in info.metrics}
        bad = {k: v for k, v in values.items() if not np.isfinite(v)}
        if bad:
            names = {"loss": "loss", "grad_norm": "gradient norm"}
            what = " and ".join(f"{names[k]} ({v})" for k, v in bad.items())
    return f"{where} gave a non-finite {what}"


def message(run, step: int, info: StepInfo | None, steps_per_epoch: int | None,
            rollbacks: int | None = None) -> str:
    """The ``NonFiniteError`` text: where, what was (not) saved, what to do."""
    saved = run.newest_checkpoint()  # a save in flight (of an earlier, finite step) waited for
    kept = f"the newest checkpoint, {saved}, is the last finite state" if saved else \
        "no checkpoint was written"
    tried = "" if not rollbacks else f" after {rollbacks} rollback(s)"
    return (f"{describe(step, info, steps_per_epoch)}: training stopped{tried} without "
            f"applying it, and no state from that step on was saved ({kept}). Lower the "
            "learning rate (or clip gradients), and look for log(0), division by zero or "
            "overflow in the loss on that batch; or choose a policy: "
            "on_nonfinite='skip' leaves such updates out and goes on, "
            "on_nonfinite='rollback' returns to the newest checkpoint and goes on after "
            "the batch")


def zero_flag(sharding):
    """A state's ``nonfinite_step`` when nothing went wrong, on ``sharding``."""
    # jit, not device_put: the sharding may span processes
    return jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=sharding)()
