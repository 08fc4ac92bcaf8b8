"""The shipped models' embeddings of a fixed text list, as digests: run it under two code versions and
compare the JSON files to show a refactor changed no embedding bit.

    python benchmarks/embedding_digest.py --out now.json
    PYTHONPATH=OLD_TREE python benchmarks/embedding_digest.py --out old.json --compare now.json   # the old code

Texts: the first --texts STS-B dev sentences (built-in sentences without the data folder), encoded by every
shipped model (the GRACE default, GIRCSE's and GRC's: ``default_model_path(method=...)``) three ways, as a user
does: ``encode`` (the ``default`` prompt type), ``encode_query`` and ``encode_document``, each at the model's
own budget for that prompt type. Each gets the sha256 of its float32 bytes; with ``--compare`` each
is checked against the other file's (whose texts it encodes), and the largest absolute difference is printed
where they differ. Only ``grace_st.default_model_path`` and ``grace_st.load`` are needed of the package, so an
older tree runs it too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

import grace_st

METHODS = ("grace", "gircse", "grc")  # every shipped model: default_model_path(method=...)


def digests(texts: list[str], batch_size: int) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    arrays = {}
    for method in METHODS:
        model = grace_st.load(grace_st.default_model_path(method=method), device="cpu")
        calls = {"encode": model.encode, "encode_query": model.encode_query, "encode_document": model.encode_document}
        for name, call in calls.items():
            key = name if method == "grace" else f"{method}/{name}"
            arrays[key] = np.asarray(call(texts, batch_size=batch_size), dtype=np.float32)
    return {name: hashlib.sha256(array.tobytes()).hexdigest() for name, array in arrays.items()}, arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", required=True, help="JSON: the digests, and the embeddings as lists")
    parser.add_argument("--compare", help="an earlier --out file to check against")
    args = parser.parse_args()
    earlier = json.loads(Path(args.compare).read_text()) if args.compare else None
    if earlier:
        texts, source = earlier["texts"], earlier["source"]
    else:
        try:
            from scoreboard import sentences  # benchmarks/scoreboard.py, beside this script
        except ImportError:
            from scoreboard import sentences

        texts, source = sentences(args.texts)
    found, arrays = digests(texts, args.batch_size)
    report = {
        "source": source,
        "texts": texts,
        "batch_size": args.batch_size,
        "sha256": found,
        "embeddings": {name: array.tolist() for name, array in arrays.items()},
    }
    Path(args.out).write_text(json.dumps(report))
    for name, digest in found.items():
        print(f"{name:<16} {digest}")
    if earlier:
        for name, digest in found.items():
            if name not in earlier["sha256"]:
                print(f"{name:<16} not in {args.compare}")
            elif earlier["sha256"][name] == digest:
                print(f"{name:<16} bit-identical to {args.compare}")
            else:
                gap = np.abs(np.asarray(earlier["embeddings"][name], dtype=np.float32) - arrays[name]).max()
                print(f"{name:<16} DIFFERS from {args.compare}: max |difference| {gap:.3g}")


if __name__ == "__main__":
    main()
