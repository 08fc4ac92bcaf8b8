"""The name and revision a GRACE model is filed under by evaluation libraries.

mteb caches results by ``model_card_data.model_name`` and ``base_model_revision``. A model
with no Hub id would be filed under ``None`` and reuse one checkpoint's scores for the next, so
:func:`describe_for_mteb` names it ``local/<directory>`` with a revision that changes with the
weights or the settings (:func:`revision`); a model loaded by Hub id keeps its repository id and
commit.
"""

from __future__ import annotations

import hashlib
import json
import os

from grace_st.cache import NEUTRAL_SETTINGS
from grace_st.files.hub import snapshot_repo


def model_id(name_or_path: str) -> str:
    """A Hub id stays as it is, and so does a snapshot of one in the Hugging Face cache
    (``.../models--org--name/snapshots/<commit>`` is ``org/name``); a local directory becomes
    ``local/<directory name>`` (mteb wants an ``organisation/name`` shape)."""
    snapshot = snapshot_repo(name_or_path)
    if snapshot is not None:
        return snapshot[0] if snapshot[0].count("/") == 1 else f"local/{snapshot[0]}"
    if os.path.isdir(name_or_path) or name_or_path.count("/") != 1:
        return f"local/{os.path.basename(os.path.abspath(name_or_path)) or 'grace-model'}"
    return name_or_path


# The rationale cache's neutral values, less the repetition penalty, which revisions hashed from the start.
ADDED_LATER = {name: value for name, value in NEUTRAL_SETTINGS.items() if name != "repetition_penalty"}


def revision(encoder) -> str:
    """The weights' fingerprint and a hash of the current settings: what determines an embedding."""
    if encoder.weights_revision is None:
        encoder.weights_revision = encoder.weights_key()[:16]
    # merge_adapter changes how the weights are held, not what they compute; a setting added since results were
    # first filed, at the value that computes what was computed before it, leaves the revision as it was
    settings = {
        k: v
        for k, v in encoder.get_config_dict().items()
        if k not in ("weights_revision", "merge_adapter") and not (k in ADDED_LATER and v == ADDED_LATER[k])
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return f"{encoder.weights_revision}-{digest}"


def describe_for_mteb(encoder, model) -> None:
    """Give ``model`` (the SentenceTransformer around ``encoder``) a name and revision in its model
    card data, where mteb reads them. A Hub-loaded model (a snapshot in the Hugging Face cache) is
    filed under its repository id and commit, the commit even where the revision asked for was a
    branch or tag; settings changed at run time add a hash of them to the commit. Values a user
    set are left alone: only None, or what an earlier call wrote, is replaced."""
    card = model.model_card_data
    ours_name, ours_revision = encoder._described
    snapshot = snapshot_repo(encoder._source_path)
    if snapshot is not None:
        commit, current = snapshot[1], revision(encoder)
        saved = getattr(encoder, "_snapshot_revision", None)  # the settings it was saved with (see load)
        filed = commit
        if saved not in (None, current):
            filed = f"{commit}-{hashlib.sha256(current.encode()).hexdigest()[:8]}"
        if card.model_name in (None, ours_name):
            card.model_name = encoder.model_id
        # the first time, sentence-transformers' value (None, or a branch name) gives way to the commit
        if encoder._described == (None, None) or card.base_model_revision == ours_revision:
            card.base_model_revision = filed
        encoder._described = (card.model_name, card.base_model_revision)
        return
    if card.base_model and ours_name is None:  # loaded from the Hub: its id and commit stand
        return
    if card.model_name in (None, ours_name):
        card.model_name = encoder.model_id
    if card.base_model_revision in (None, ours_revision):
        card.base_model_revision = revision(encoder)
    encoder._described = (card.model_name, card.base_model_revision)
