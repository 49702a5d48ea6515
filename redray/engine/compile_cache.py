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
    compiled); returns the folder. A process that ran another run before (a kept host)
    moves its cache to ``folder``: JAX opens its cache once, at the first compile, and
    keeps writing where it opened it unless told to open it again."""
    import jax
    from jax._src import compilation_cache

    if "://" not in folder:
        os.makedirs(folder, exist_ok=True)
    moved = jax.config.jax_compilation_cache_dir != folder
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if moved:
        compilation_cache.reset_cache()
    return folder
