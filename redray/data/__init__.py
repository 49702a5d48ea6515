"""Data sources: in-memory ones as Ray Datasets with row access from every host
(``sources.py``); files streamed through Ray Data (``stream.py`` over ``corpus.py``);
a corpus preprocessed once on the cluster (``prepare.py``), packed (``packing.py``);
conversations rendered with their chat template and loss masks (``chat.py``)."""

from redray.data import chat
from redray.data.corpus import Corpus, Piece
from redray.data.packing import efficiency, next_token_mask, pack
from redray.data.prepare import Prepared, prepare
from redray.data.sources import RowSource, to_dataset
from redray.data.stream import Stream

__all__ = ["Corpus", "chat", "Piece", "Prepared", "RowSource", "Stream", "efficiency",
           "next_token_mask", "pack", "prepare", "to_dataset"]
