"""The data layer: every dataset format grace-st reads, parsed in one place (:mod:`.formats`)
on top of line-numbered table and JSON-lines readers (:mod:`.files`). Training, the local mteb
tasks and the benchmarks all read through it. Standard library only."""

from __future__ import annotations

from grace_st.data.files import SCOREBOARD_SEED, DataFileError, id_fraction, scoreboard_sample
from grace_st.data.formats import (
    BeirFolder,
    BeirRecord,
    LabelledPair,
    LabelledText,
    ScoredPair,
    TripletRecord,
    read_beir,
    read_labelled_pairs,
    read_labelled_texts,
    read_scored_pairs,
    read_texts,
    read_triplets,
)

__all__ = [
    "SCOREBOARD_SEED",
    "BeirFolder",
    "BeirRecord",
    "DataFileError",
    "LabelledPair",
    "LabelledText",
    "ScoredPair",
    "TripletRecord",
    "id_fraction",
    "read_beir",
    "read_labelled_pairs",
    "read_labelled_texts",
    "read_scored_pairs",
    "read_texts",
    "read_triplets",
    "scoreboard_sample",
]
