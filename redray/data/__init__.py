"""Data sources: in-memory ones as Ray Datasets with row access from every host
(``sources.py``), and files streamed through Ray Data (``stream.py`` over ``corpus.py``)."""

from redray.data.corpus import Corpus, Piece
from redray.data.sources import RowSource, to_dataset
from redray.data.stream import Stream

__all__ = ["Corpus", "Piece", "RowSource", "Stream", "to_dataset"]
