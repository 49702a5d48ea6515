"""What a driver keeps from one run for its next: actors whose processes have started
and imported what they need (a second run takes them instead of waiting for new ones).

Each kind keeps at most one, for this driver's Ray connection only (``session``): a
new ``ray.init`` ends every actor of the old one. A run takes what is kept (``take``)
and gives it back when it ended well (``keep``); two runs at once each get their own.
"""

from __future__ import annotations

from typing import Any, Callable

import ray


def session() -> str:
    """This driver's Ray connection (a new ``ray.init`` is another)."""
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


class Kept:
    """At most one kept thing of a kind, with the session it belongs to."""

    def __init__(self):
        self.item: Any = None
        self.session: str | None = None

    def take(self, usable: Callable[[Any], bool] = lambda item: True) -> Any:
        """The kept item if it belongs to this session and ``usable(item)``, else None.
        Either way nothing is kept after: an item that is not usable is forgotten
        (``usable`` may end it, as ``hosts.take`` does)."""
        item, kept_session = self.item, self.session
        self.item = self.session = None
        if item is None or kept_session != session():
            return None
        return item if usable(item) else None

    def keep(self, item: Any, drop: Callable[[Any], None] = lambda item: None) -> None:
        """Keeps ``item`` for the next run; one kept before is ended with ``drop``."""
        old = self.take()
        if old is not None:
            drop(old)
        self.item, self.session = item, session()


def answers(actor, method: str = "ready", timeout: float = 10.0) -> bool:
    """Whether ``actor`` answers a call of ``method`` within ``timeout`` seconds."""
    try:
        ray.get(getattr(actor, method).remote(), timeout=timeout)
        return True
    except Exception:  # noqa: BLE001 - gone, or not answering: not usable
        return False
