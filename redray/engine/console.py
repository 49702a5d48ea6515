"""Where a Trainer's messages and progress go, and how a progress row reads.

A Trainer says a few things on process 0 (its mesh and sizes, a resume, each
evaluation) and shows its progress. By default both go to this process's terminal: a
tqdm bar over the run's budget. Inside ``redray.fit``/``redray.run`` the run gives the
Trainer the driver's console instead (``redray/cluster/console.py``), so the user
watches one line on the machine they started the run from.
"""

from __future__ import annotations

from redray.engine.hooks import Hook, StepInfo


class Console:
    """This process's terminal: messages printed, progress as a tqdm bar."""

    def say(self, text: str) -> None:
        import sys

        from tqdm.auto import tqdm

        tqdm.write(text)  # above an open bar, which redraws below it
        sys.stdout.flush()

    def progress(self, run, total: int) -> Hook:
        """The hook that shows the progress of ``run`` towards step ``total``."""
        return ProgressBar(run.step, total)


class ProgressBar(Hook):
    """One tqdm bar from the fit's first step to the run's budget (``total`` steps),
    with the last window's loss and speed."""

    def __init__(self, start: int, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=min(start, total), desc="train", leave=False,
                        dynamic_ncols=True)

    def on_epoch_start(self, run, epoch: int, batch: int) -> None:
        self.bar.set_description(f"epoch {epoch}")
        self.bar.n = min(run.step, self.bar.total)  # a rollback goes back
        self.bar.refresh()

    def on_step(self, run, info: StepInfo) -> None:
        self.bar.update(1)

    def on_log(self, run, row: dict) -> None:
        if "steps_per_s" in row:
            self.bar.set_postfix_str(speed_text(row))

    def on_fit_end(self, run) -> None:
        self.bar.close()


def speed_text(row: dict) -> str:
    """A train row's loss and speed: ``loss 4.512 | 8.3 steps/s | 5,300 tokens/s``
    (examples/s where the batch's tokens are unknown)."""
    parts = [f"loss {row['loss']:.4g}"] if "loss" in row else []
    parts.append(f"{row['steps_per_s']:.3g} steps/s")
    if row.get("tokens_per_s"):
        parts.append(f"{row['tokens_per_s']:,.0f} tokens/s")
    elif "examples_per_s" in row:
        parts.append(f"{row['examples_per_s']:,.0f} examples/s")
    return " | ".join(parts)


def duration_text(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_text(row: dict, total: int | None) -> str:
    """One line for a logged train row: the step against the run's budget, epoch, loss,
    speed and the time left at that speed:
    ``step 120/300 (40%) | epoch 0 | loss 4.512 | 8.3 steps/s | 5,300 tokens/s | ETA 22s``.
    """
    step = row["step"]
    where = f"step {step}"
    if total:
        where += f"/{total} ({100 * step / total:.0f}%)"
    parts = [where, f"epoch {row['epoch']}"] if "epoch" in row else [where]
    parts.append(speed_text(row))
    if total and row.get("steps_per_s"):
        parts.append(f"ETA {duration_text(max(total - step, 0) / row['steps_per_s'])}")
    return " | ".join(parts)


def row_text(row: dict) -> str:
    """Any other logged row (an evaluation, a rollback), in the progress line's style:
    ``step 20 | epoch 0 | eval_loss 5.963``."""
    return " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in row.items())


def is_progress(row: dict) -> bool:
    """A train window's row (speed measured), as opposed to an evaluation's."""
    return "steps_per_s" in row
