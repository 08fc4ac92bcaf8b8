"""``grace-st encode-corpus`` on Ray Data against ``model.encode_document`` in one process, on the same texts.

Cells, for each document rationale budget: (a) ``encode_document`` in this process, every CPU as torch threads
(the model's load timed with it); (b) ``encode_corpus`` with 1 actor x every CPU; (c) with 2 actors x 1 thread;
(d) on a two-node local Ray cluster (``ray.cluster_utils.Cluster``, one CPU a node) with 2 actors x 1 thread.
The Ray cells' time is the whole call: the input check, Ray's start, the actors' model loads, the pipeline and
the output's check, as a user waits for it; ``pipeline`` is read → map_batches → write_parquet alone. Each Ray
cell's embeddings are compared with (a)'s (max |difference|: 0 when bit-equal). Offline: the texts are STS-B
dev sentences from the shared data folder (built-in sentences when it is absent). Prints a table, writes JSON.

    python benchmarks/corpus_encode.py                       # 2,000 texts, budgets 0 and 8
    python benchmarks/corpus_encode.py --texts 200 --budgets 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

import grace_st
from grace_st.corpus import encode_corpus
from scoreboard import FALLBACK_SENTENCES, data_dir


def corpus_texts(count: int) -> tuple[list[str], str]:
    """``count`` distinct real sentences: STS-B dev's sentence1 and sentence2 in file order."""
    from grace_st.data.formats import read_scored_pairs

    dev = data_dir() / "stsb" / "dev.tsv"
    if dev.is_file():
        seen = {}
        for pair in read_scored_pairs(dev):
            for text in (pair.sentence1, pair.sentence2):
                seen.setdefault(text, None)
        texts = list(seen)[:count]
        return texts, f"STS-B dev sentences (sentence1 and sentence2, distinct), first {len(texts)}"
    texts = [f"{text} ({index})" for index, text in enumerate(FALLBACK_SENTENCES * (count // 8 + 1))][:count]
    return texts, f"{len(FALLBACK_SENTENCES)} built-in sentences, numbered, to {count}"


def in_process(model_path: str, texts: list[str], budget: int, batch_size: int) -> tuple[dict, np.ndarray]:
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    model = grace_st.load(model_path, device="cpu")
    encoder = model[0]
    current = encoder.max_rationale_tokens
    encoder.max_rationale_tokens = {**current, "document": budget} if isinstance(current, dict) else {
        "default": current, "document": budget}
    loaded = time.perf_counter()
    vectors = model.encode_document(texts, batch_size=batch_size, convert_to_numpy=True)
    seconds = time.perf_counter() - start
    del model
    return {"cell": "a in-process encode_document", "actors": 0, "threads": os.cpu_count(), "seconds": seconds,
            "load_seconds": loaded - start, "pipeline_seconds": None}, vectors


def ray_cell(label: str, corpus: str, folder: str, model_path: str, budget: int, batch_size: int, actors: int,
             threads: int, address: str | None = None) -> tuple[dict, dict]:
    out = os.path.join(folder, label.split()[0])
    summary = encode_corpus(
        corpus, out, model=model_path, actors=actors, threads_per_actor=threads, batch_size=batch_size,
        address=address, settings={"max_rationale_tokens": {"document": budget}}, progress=False,
        rows_per_shard=max(batch_size, 64),
    )
    table = pq.read_table(out)
    found = dict(zip(table.column("id").to_pylist(), np.array(table.column("embedding").to_pylist(), np.float32)))
    return {"cell": label, "actors": actors, "threads": threads, "seconds": summary["seconds"],
            "load_seconds": None, "pipeline_seconds": summary["pipeline_seconds"]}, found


def two_node_cell(*args) -> tuple[dict, dict]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        return ray_cell("d two-node cluster", *args, actors=2, threads=1, address=cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GRACE model directory (default: the embedded default model)")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 8], help="document rationale budgets")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--note", default="", help="a line on the machine's state, kept in the JSON")
    parser.add_argument("--out", default="benchmarks/results/corpus_encode.json")
    args = parser.parse_args()

    model_path = args.model or grace_st.default_model_path()
    texts, source = corpus_texts(args.texts)
    cpus = os.cpu_count()
    report = {
        "model": model_path, "texts": len(texts), "source": source, "batch_size": args.batch_size, "cpus": cpus,
        "cpu": platform.processor() or platform.machine(), "load_average_before": os.getloadavg(),
        "note": args.note, "budgets": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        corpus = os.path.join(folder, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"id": index, "text": text}) + "\n" for index, text in enumerate(texts))
        for budget in args.budgets:
            cells = []
            base, reference = in_process(model_path, texts, budget, args.batch_size)
            base["max_abs_difference"] = 0.0
            cells.append(base)
            run = os.path.join(folder, f"g{budget}")
            common = (corpus, run, model_path, budget, args.batch_size)
            shapes = [("b 1 actor", 1, cpus)]
            if cpus >= 2:
                shapes += [("c 2 actors", 2, 1), ("d two-node cluster", 2, 1)]
            for label, actors, threads in shapes:
                if label.startswith("d"):
                    cell, found = two_node_cell(*common)
                else:
                    cell, found = ray_cell(label, *common, actors=actors, threads=threads)
                difference = max(np.abs(found[i] - reference[i]).max() for i in range(len(texts)))
                cell["max_abs_difference"] = float(difference)
                cells.append(cell)
                print(f"G={budget} {cell['cell']}: {cell['seconds']:.1f} s", flush=True)
            for cell in cells:
                cell["texts_per_second"] = len(texts) / cell["seconds"]
                cell["time_vs_in_process"] = cell["seconds"] / base["seconds"]
            report["budgets"][str(budget)] = cells
    report["load_average_after"] = os.getloadavg()
    print(table(report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def table(report: dict) -> str:
    lines = [
        f"{report['texts']} texts ({report['source']}), batch {report['batch_size']}, {report['cpus']} CPUs",
        "| G | cell | actors x threads | wall s | texts/s | time vs (a) | pipeline s | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for budget, cells in report["budgets"].items():
        for cell in cells:
            shape = "-" if not cell["actors"] else f"{cell['actors']} x {cell['threads']}"
            pipeline = f"{cell['pipeline_seconds']:.1f}" if cell["pipeline_seconds"] is not None else "-"
            lines.append(
                f"| {budget} | {cell['cell']} | {shape} | {cell['seconds']:.1f} | {cell['texts_per_second']:.2f} | "
                f"{cell['time_vs_in_process']:.2f} | {pipeline} | {cell['max_abs_difference']:g} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
