"""``grace-st serve`` under load, against ``encode_query`` one request at a time, side by side in one run.

For each weight form (float32 as saved, int8 weight-only) the script starts ``grace-st serve`` on the
embedded default in a subprocess (loopback, a free port) and loads the same model here. Then, for each
mix of texts:

- ``query``: real queries (held-back SciFact claims, Banking77 held-out texts) as ``input_type: query``,
  at the shipped query budget;
- ``document``: SciFact abstracts as ``input_type: document`` (the shipped document budget);
- ``text``: the same queries with no ``input_type`` (the shipped default budget: a rationale is written);
- ``query-G32``: the queries with a 32-token query rationale (server and model at ``query=32``: what a
  user who turns query rationales on gets, and where decoding, not the prompt pass, is the cost),

it times the texts sent one by one to the in-process model (``encode_query`` / ``encode_document`` /
``encode``: what a web app wrapping the model does per request; the ``sequential`` row), then 1, 8, 32 and
64 concurrent clients, each sending one text a request and the next when answered, ``--requests`` requests
in all (bounded by ``--seconds`` a cell). Reported: texts/s, the ratio to the sequential row, latency
p50/p95/p99, and rows a decoding step / a prompt pass fed on average (the server's ``/metrics``). Every
answer is checked against the in-process model's embedding (bit for bit in float32).

Each server runs with the instruction prefix cache on and off (``--prefix-cache on off``; off is
``grace-st serve --prefix-cache-mb 0``), and each cell reports **work%**: the FLOPs of the tokens a text needs
computed (its prompt after the shared instruction prefix, and its rationale's tokens, at 2 FLOPs a weight a token
plus attention over the context; the LM head where a token's logits are read) divided by the cell's time, as a
share of this machine's matmul peak measured at the start of the run (``matmul_peak_flops``: float32, or for int8
the kernel its many-row products run, bfloat16 where the CPU has bfloat16 kernels). The same numerator with the
cache off, so off/on compare work done per second; 100 % would be every core at its matmul peak on nothing but
those tokens.

``--soak N`` then sends N requests from 32 clients, a fifth of them bad (malformed JSON, token arrays,
empty lists, unknown models, lone surrogates, texts over the limit, UTF-16 bodies, nesting and integers
too deep or long for Python's parser, falsy fields), one in 40 an upload its client abandons half-way, and
reports wrong answers, 5xx (as the clients saw them and as the server's ``/metrics`` counted them: a client
that left is a 499 there, never a 5xx) and the server's resident memory at the start and the end.

The clients run in this process, on the same cores as the server: on a 2-core machine they take a share
of the CPU, so the ratios understate what a server with its own cores gets.

    python benchmarks/serve_load.py                      # float32 and int8, every mix, then a 2,000-request soak
    python benchmarks/serve_load.py --weights float32 --mixes query --clients 1 32 --soak 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

import grace_st
from grace_st.data.formats import read_beir
from scoreboard import banking77, data_dir, scifact, write_json

RESULTS = Path(__file__).resolve().parent / "results"
WEIGHTS = {"float32": {}, "int8": {"weight_quantization": "int8"}}
PREFIX_CACHE = {"on": None, "off": 0}  # grace-st serve --prefix-cache-mb (None: its default)
# mix -> (input_type, budget override of the served and the in-process model)
MIXES = {
    "query": ("query", None),
    "document": ("document", None),
    "text": (None, None),
    "query-G32": ("query", "query=32"),
}


def texts_for(mix: str, count: int) -> list[str]:
    data = data_dir()
    if not data.is_dir():
        raise SystemExit(
            f"{data} is missing: this benchmark sends real texts from the shared data folder ($GRACE_ST_DATA)"
        )
    if mix == "document":
        corpus = read_beir(data / "scifact", "train").corpus
        return [f"{doc.title}\n{doc.text}".strip() for doc in list(corpus.values())[:count]]
    claims, _, _ = scifact(data / "scifact", 0, 0)
    texts = list(claims.values())
    _, _, banking, _ = banking77(data / "banking77" / "train.csv", 500, max(0, count - len(texts)))
    return (texts + banking)[:count]


def local_encode(model, mix: str):
    input_type = MIXES[mix][0]
    return {"query": model.encode_query, "document": model.encode_document, None: model.encode}[input_type]


class Server:
    """``grace-st serve`` in a subprocess on a free loopback port."""

    def __init__(self, weights: str, slots: int, budgets: str | None = None, prefix_cache_mb: float | None = None):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "grace_st.cli",
            "serve",
            "--port",
            str(self.port),
            "--model-name",
            "default",
            "--log-level",
            "warning",
            "--slots",
            str(slots),
            "--max-queue",
            "4096",
            "--max-chars",
            "8000",
        ]
        if weights == "int8":
            command += ["--weight-quantization", "int8"]
        if budgets:
            command += ["--max-rationale-tokens", budgets]
        if prefix_cache_mb is not None:
            command += ["--prefix-cache-mb", str(prefix_cache_mb)]
        self.process = subprocess.Popen(command)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                httpx.get(f"{self.url}/health")
                return
            except httpx.ConnectError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("grace-st serve did not start") from None
                time.sleep(0.5)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(("grace_st_rows_per_step_", "grace_st_rows_per_prompt_pass_")) and "{" not in line:
                name, value = line.split()
                values[name] = float(value)
        return values

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def flops(model, prompt: int, prefix: int, rationale: int) -> float:
    """The FLOPs of one text's own tokens: its prompt after the ``prefix`` (the cached instruction prefix), then
    its ``rationale`` tokens (each decoding step reads the LM head; the prompt's last token does where a rationale
    follows). 2 a weight of every decoder linear layer a token, and attention's 4 · hidden a layer a context column."""
    config = model.config.get_text_config()
    layers, hidden = config.num_hidden_layers, config.hidden_size
    linear = sum(
        m.in_features * m.out_features for name, m in model.get_decoder().named_modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
    )
    head = config.vocab_size * hidden
    total = 0.0
    for position in range(prefix, prompt + rationale):
        total += 2 * linear + 4 * layers * hidden * (position + 1)
        if position >= prompt - 1 and rationale:
            total += 2 * head
    return total


def matmul_peak(weights: str) -> float:
    """This machine's matmul peak for the kernel ``weights``' prompt passes run (FLOP/s)."""
    import torch

    from grace_st.runtime.cpu.packed_linear import matmul_peak_flops, native_bfloat16

    dtype = torch.bfloat16 if weights == "int8" and native_bfloat16() else torch.float32
    return matmul_peak_flops(dtype)[0]


def per_step(before: dict, after: dict, name: str) -> float | None:
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    return round((after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)) / count, 1) if count else None


def load_cell(
    server: Server,
    texts: list[str],
    input_type: str | None,
    clients: int,
    requests: int,
    seconds: float,
    reference: np.ndarray,
    work: list[float] | None = None,
    peak: float | None = None,
) -> dict:
    """``clients`` threads, one text a request, until ``requests`` are answered or ``seconds`` pass."""
    lock, latencies, wrong, answered, worst, done_flops = threading.Lock(), [], [0], [0], [0.0], [0.0]
    next_index = [0]
    stop_at = time.monotonic() + seconds

    def client():
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < stop_at:
                with lock:
                    if next_index[0] >= requests:
                        return
                    index = next_index[0]
                    next_index[0] += 1
                body = {"model": "default", "input": texts[index % len(texts)]}
                if input_type:
                    body["input_type"] = input_type
                start = time.perf_counter()
                response = http.post(f"{server.url}/v1/embeddings", json=body)
                elapsed = time.perf_counter() - start
                vector = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
                with lock:
                    latencies.append(elapsed)
                    answered[0] += 1
                    done_flops[0] += work[index % len(texts)] if work else 0.0
                    wrong[0] += not np.array_equal(vector, reference[index % len(texts)])
                    worst[0] = max(worst[0], float(np.abs(vector - reference[index % len(texts)]).max()))

    before = server.metrics()
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    wall = time.perf_counter() - start
    after = server.metrics()
    q = np.percentile(latencies, [50, 95, 99])
    return {
        "clients": clients,
        "texts": answered[0],
        "texts_per_s": answered[0] / wall,
        "p50_s": float(q[0]),
        "p95_s": float(q[1]),
        "p99_s": float(q[2]),
        "not_bit_equal": wrong[0],
        "max_abs_diff": worst[0],
        "rows_per_decoding_step": per_step(before, after, "grace_st_rows_per_step"),
        "rows_per_prompt_pass": per_step(before, after, "grace_st_rows_per_prompt_pass"),
        "work_fraction": done_flops[0] / wall / peak if work and peak else None,
    }


def sequential_cell(model, mix: str, texts: list[str], count: int) -> tuple[dict, np.ndarray, list[float]]:
    """The texts one ``encode`` call each; with each text's embedding and FLOPs (:func:`flops`)."""
    encode = local_encode(model, mix)
    encode(texts[:1])  # warm-up
    vectors, latencies, work = [], [], []
    rows, span = model[0].prompt_token_ids(texts[:count], task=MIXES[mix][0])
    start = time.perf_counter()
    for text, row in zip(texts[:count], rows):
        t0 = time.perf_counter()
        out = encode([text], output_value=None)[0]
        latencies.append(time.perf_counter() - t0)
        vectors.append(out["sentence_embedding"].float().numpy())
        stops = set(model[0].eos_token_ids)
        ids = out["rationale_token_ids"].reshape(-1).tolist()
        written = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
        work.append(flops(model[0].model, len(row), min(span, len(row) - 1), written if ids else 0))
    wall = time.perf_counter() - start
    q = np.percentile(latencies, [50, 95, 99])
    cell = {
        "clients": "sequential",
        "texts": count,
        "texts_per_s": count / wall,
        "p50_s": float(q[0]),
        "p95_s": float(q[1]),
        "p99_s": float(q[2]),
    }
    return cell, np.stack(vectors), work


BAD_BODIES = [
    b"{not json",
    b'{"model": "default", "input": [1, 2, 3]}',
    b'{"model": "default", "input": []}',
    b'{"model": "gpt-4", "input": "x"}',
    b'{"model": "default", "input": "\\ud800"}',
    json.dumps({"model": "default", "input": "x" * 9000}).encode(),
    json.dumps({"model": "default", "input": "x"}).encode("utf-16"),
    b'{"model": "default", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "default", "input": "x", "dimensions": ' + b"9" * 5000 + b"}",
    b'{"model": "default", "input": "x", "encoding_format": ""}',
    b'{"model": "default", "input": "x", "input_type": 0}',
]


def abandoned_upload(server: Server) -> None:
    """A client that announces a body and leaves half-way through sending it."""
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 4000\r\n\r\n{"model": "default", "input": "half a body'
        )
        time.sleep(0.05)


def server_5xx(server: Server) -> int:
    """5xx answers of any route, as the server's own metrics count them."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("grace_st_requests_total{") and 'status="5' in line:
            total += float(line.split()[-1])
    return int(total)


def soak(server: Server, texts: list[str], reference: np.ndarray, count: int, clients: int = 32) -> dict:
    """``count`` requests from ``clients`` threads, every fifth bad; good ones checked against ``reference``."""
    rss_start, server_5xx_start = server.rss_mb(), server_5xx(server)
    lock, tally = threading.Lock(), {"good": 0, "wrong": 0, "bad_4xx": 0, "5xx": 0, "other": 0, "left": 0}
    counter = iter(range(count))

    def client():
        with httpx.Client(timeout=300) as http:
            for number in counter:
                if number % 40 == 39:
                    abandoned_upload(server)
                    key = "left"
                elif number % 5 == 4:
                    response = http.post(f"{server.url}/v1/embeddings", content=BAD_BODIES[number % len(BAD_BODIES)])
                    key = (
                        "bad_4xx"
                        if 400 <= response.status_code < 500
                        else "5xx"
                        if response.status_code >= 500
                        else "other"
                    )
                else:
                    index = number % len(texts)
                    response = http.post(
                        f"{server.url}/v1/embeddings",
                        json={"model": "default", "input": texts[index], "input_type": "query"},
                    )
                    if response.status_code >= 500:
                        key = "5xx"
                    else:
                        vector = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
                        key = "good" if np.array_equal(vector, reference[index]) else "wrong"
                with lock:
                    tally[key] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return {
        "requests": count,
        "clients": clients,
        **tally,
        "seconds": time.perf_counter() - start,
        "server_5xx": server_5xx(server) - server_5xx_start,
        "rss_start_mb": rss_start,
        "rss_end_mb": server.rss_mb(),
    }


def table(report: dict) -> str:
    lines = [
        "| weights | prefix cache | mix | clients | texts | texts/s | × sequential | p50 s | p95 s | p99 s | work % "
        "| rows/step | rows/prompt pass | not bit-equal (max abs diff) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        base = run["cells"][0]["texts_per_s"]
        for cell in run["cells"]:
            lines.append(
                f"| {run['weights']} | {run.get('prefix_cache', 'off')} | {run['mix']} | {cell['clients']} | "
                f"{cell['texts']} | {cell['texts_per_s']:.2f} | "
                f"{cell['texts_per_s'] / base:.2f} | {cell['p50_s']:.3f} | {cell['p95_s']:.3f} | {cell['p99_s']:.3f} | "
                + (f"{cell['work_fraction']:.0%} | " if cell.get("work_fraction") is not None else "– | ")
                + f"{cell.get('rows_per_decoding_step') or '–'} | {cell.get('rows_per_prompt_pass') or '–'} | "
                + (f"{cell['not_bit_equal']} ({cell['max_abs_diff']:.1e}) |" if "not_bit_equal" in cell else "– |")
            )
    for weights, result in report.get("soak", {}).items():
        lines.append("")
        lines.append(
            f"Soak ({weights}): {result['requests']} requests from {result['clients']} clients in "
            f"{result['seconds']:.0f} s: {result['good']} good answered bit for bit, {result['wrong']} wrong, "
            f"{result['bad_4xx']} bad answered 4xx, {result['left']} uploads abandoned, {result['5xx']} 5xx "
            f"({result['server_5xx']} in the server's metrics); server memory {result['rss_start_mb']:.0f} MB "
            f"at the start, {result['rss_end_mb']:.0f} MB at the end."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=list(WEIGHTS))
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--requests", type=int, default=96, help="requests a cell (and texts for the sequential row)")
    parser.add_argument("--seconds", type=float, default=60, help="a cell stops after this long")
    parser.add_argument("--slots", type=int, default=64, help="the server's --slots")
    parser.add_argument("--soak", type=int, default=2000, help="requests of the soak (0: none)")
    parser.add_argument("--prefix-cache", nargs="+", choices=list(PREFIX_CACHE), default=["off", "on"])
    parser.add_argument("--output", default=str(RESULTS / "serve_load.json"))
    args = parser.parse_args()

    peaks = {weights: matmul_peak(weights) for weights in args.weights}
    report = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "settings": vars(args),
        "matmul_peak_GFLOPs": {weights: peak / 1e9 for weights, peak in peaks.items()},
        "runs": [],
        "soak": {},
    }
    for weights, cached in [(w, c) for w in args.weights for c in args.prefix_cache]:
        model = grace_st.load(grace_st.default_model_path(), device="cpu", model_kwargs=WEIGHTS[weights] or None)
        model[0].decode_options = dataclasses.replace(model[0].decode_options, prefix_cache=cached == "on")
        shipped = dict(model[0].max_rationale_tokens)
        for budgets in dict.fromkeys(MIXES[mix][1] for mix in args.mixes):
            override = dict(item.split("=") for item in budgets.split(",")) if budgets else {}
            model[0].max_rationale_tokens = {**shipped, **{k: int(v) for k, v in override.items()}}
            server = Server(weights, args.slots, budgets, PREFIX_CACHE[cached])
            try:
                for mix in [m for m in args.mixes if MIXES[m][1] == budgets]:
                    input_type = MIXES[mix][0]
                    texts = texts_for(mix, args.requests)
                    sequential, reference, work = sequential_cell(model, mix, texts, len(texts))
                    sequential["work_fraction"] = sum(work) / (len(texts) / sequential["texts_per_s"]) / peaks[weights]
                    cells = [sequential]
                    warm = {
                        "model": "default",
                        "input": texts[:4],
                        **({"input_type": input_type} if input_type else {}),
                    }
                    # the first calls bind the native step
                    httpx.post(f"{server.url}/v1/embeddings", json=warm, timeout=300)
                    for clients in args.clients:
                        cells.append(
                            load_cell(
                                server, texts, input_type, clients, args.requests, args.seconds, reference, work,
                                peaks[weights],
                            )
                        )
                        print(
                            f"{weights} prefix cache {cached} {mix} {clients} clients: "
                            f"{cells[-1]['texts_per_s']:.2f} texts/s work {cells[-1]['work_fraction']:.0%} "
                            f"({cells[-1]['texts_per_s'] / sequential['texts_per_s']:.2f}x sequential), "
                            f"p95 {cells[-1]['p95_s']:.3f} s",
                            flush=True,
                        )
                    report["runs"].append(
                        {
                            "weights": weights, "prefix_cache": cached, "mix": mix,
                            "budgets": model[0].max_rationale_tokens, "cells": cells,
                        }
                    )
                    write_json(report, args.output)
                if args.soak and weights == args.weights[0] and cached == args.prefix_cache[-1] and not budgets:
                    texts = texts_for("query", 256)
                    reference = local_encode(model, "query")(texts)
                    report["soak"][weights] = soak(server, texts, reference, args.soak)
                    write_json(report, args.output)
            finally:
                server.stop()
    markdown = table(report)
    Path(args.output).with_suffix(".md").write_text(markdown + "\n")
    print(markdown)
    wrong = sum(cell.get("not_bit_equal", 0) for run in report["runs"] for cell in run["cells"])
    wrong += sum(soak_run["wrong"] for soak_run in report["soak"].values())
    if wrong:  # the server's contract is encode's embedding, bit for bit: a run that saw otherwise fails
        sys.exit(f"{wrong} answers differ from encode's embedding")


if __name__ == "__main__":
    main()
