"""This process and the others of a run: Ray started or joined (``ray_local``), and the
processes of one JAX runtime joined and agreeing on host values (``jax_runtime``)."""
