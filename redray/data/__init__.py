"""Data sources as Ray Datasets, and row access to them from every host."""

from redray.data.sources import RowSource, to_dataset

__all__ = ["RowSource", "to_dataset"]
