"""JAX's persistent compilation cache, so a restarted or resumed run skips compiling.

A run's compiled programs (the training step, evaluation, prediction) are written to a
folder under its storage (``storage.RunFolders.compile_cache``); a process that compiles
the same program for the same devices again (a restart after a failure, a resumed run, a
second call of the same script) loads it instead. Every host reads the one folder; JAX
writes it from process 0 only (the programs are the same on every host), so on several
machines it belongs on storage they share, as the run's checkpoints do.
"""

from __future__ import annotations

import os


def enable(folder: str) -> str:
    """Turns the cache on for this process in ``folder`` (every program, however fast it
    compiled); returns the folder."""
    import jax

    if "://" not in folder:
        os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder
