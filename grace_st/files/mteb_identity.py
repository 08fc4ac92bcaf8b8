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
from collections.abc import Callable, Mapping
from typing import Any

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


def revision(settings: Mapping[str, Any], weights_revision: str) -> str:
    """The weights' fingerprint and a hash of the settings (a model's ``get_config_dict()``): what determines
    an embedding."""
    # merge_adapter changes how the weights are held, not what they compute; a setting added since results were
    # first filed, at the value that computes what was computed before it, leaves the revision as it was
    kept = {
        k: v
        for k, v in settings.items()
        if k not in ("weights_revision", "merge_adapter") and not (k in ADDED_LATER and v == ADDED_LATER[k])
    }
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:8]
    return f"{weights_revision}-{digest}"


Described = tuple[str | None, str | None]


def describe_for_mteb(
    card,
    model_id: str,
    current_revision: Callable[[], str],
    *,
    source: str | None,
    saved_revision: str | None,
    described: Described,
) -> Described:
    """Give ``card`` (a SentenceTransformer's model card data, where mteb reads them) the name ``model_id`` and
    a revision; return the (name, revision) written, to pass as ``described`` next time. A model loaded from
    ``source``, a Hub snapshot (in the Hugging Face cache), is filed under its repository id and commit, the
    commit even where the revision asked for was a branch or tag; settings changed at run time since the
    ``saved_revision`` add a hash of ``current_revision()`` to the commit. Values a user set are left alone:
    only None, or what the ``described`` call wrote, is replaced."""
    ours_name, ours_revision = described
    snapshot = snapshot_repo(source)
    if snapshot is not None:
        commit, current = snapshot[1], current_revision()
        filed = commit
        if saved_revision not in (None, current):
            filed = f"{commit}-{hashlib.sha256(current.encode()).hexdigest()[:8]}"
        if card.model_name in (None, ours_name):
            card.model_name = model_id
        # the first time, sentence-transformers' value (None, or a branch name) gives way to the commit
        if described == (None, None) or card.base_model_revision == ours_revision:
            card.base_model_revision = filed
        return card.model_name, card.base_model_revision
    if card.base_model and ours_name is None:  # loaded from the Hub: its id and commit stand
        return described
    if card.model_name in (None, ours_name):
        card.model_name = model_id
    if card.base_model_revision in (None, ours_revision):
        card.base_model_revision = current_revision()
    return card.model_name, card.base_model_revision
