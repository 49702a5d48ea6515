"""Ray 2.60's token authentication, as a client (``redray submit``, Ray Client) sees it.

A cluster started by Ray 2.60 accepts only clients that present its token. The token
is the head's ``~/.ray/auth_token``; a client reads it from ``RAY_AUTH_TOKEN`` or its
own ``~/.ray/auth_token``, and presents it only with ``RAY_AUTH_MODE=token``.
"""

from __future__ import annotations

import os

TOKEN_HELP = ("copy the head node's ~/.ray/auth_token to this machine's ~/.ray/auth_token, "
              "or export RAY_AUTH_TOKEN=<that token>")


def find_token() -> str | None:
    """The client's token: ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``
    names, else ``~/.ray/auth_token``, else None."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token.strip()
    path = os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip() or None
    return None


def use_token() -> str | None:
    """Presents the token, when there is one, in this process's connections: sets
    ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` unless they are set. Returns it."""
    token = find_token()
    if token and os.environ.get("RAY_AUTH_MODE") is None:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ.setdefault("RAY_AUTH_TOKEN", token)
        _refresh_ray_config()
    return token


def _refresh_ray_config() -> None:
    """Ray reads ``RAY_AUTH_MODE`` into its cached config when it is imported: a process
    that imported Ray first must refresh that cache to see the mode (as Ray itself does
    when it turns token auth on for a new local cluster)."""
    import sys

    if "ray" not in sys.modules:
        return
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception:  # noqa: BLE001 - a Ray without this internal: the env var still counts
        pass
