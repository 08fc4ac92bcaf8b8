"""``grace-st``: encode texts with their rationales, or build a GRACE model from a causal LM."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _encoder_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("encoder options")
    group.add_argument("--max-rationale-tokens", type=int, help="rationale length limit (0: no rationale)")
    group.add_argument("--max-input-tokens", type=int, help="prompt length limit; longer texts are cut")
    group.add_argument("--do-sample", action="store_true", default=None, help="sample rationales instead of greedy")
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--seed", type=int)
    group.add_argument("--num-rationales", type=int, help="average this many sampled rationales per text")
    group.add_argument("--hidden-layer", type=int, help="hidden states to pool (-1: last layer)")
    group.add_argument("--instruction", help="the default instruction")
    group.add_argument("--query-instruction")
    group.add_argument("--document-instruction")


def _encoder_settings(args: argparse.Namespace) -> dict:
    names = ["max_rationale_tokens", "max_input_tokens", "do_sample", "temperature", "top_p", "seed", "num_rationales", "hidden_layer"]
    settings = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    instructions = {
        key: value
        for key, value in (
            ("default", args.instruction),
            ("query", args.query_instruction),
            ("document", args.document_instruction),
        )
        if value is not None
    }
    if instructions:
        settings["instructions"] = instructions
    return settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grace-st", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    encode = commands.add_parser("encode", help="print each text's rationale, then the cosine similarity matrix")
    encode.add_argument("texts", nargs="+", help="texts to encode; '-' reads one text a line from stdin")
    encode.add_argument("--model", help="GRACE model directory or Hub id (default: the embedded default model)")
    encode.add_argument("--task", choices=["query", "document"], help="use the query or document instruction")
    encode.add_argument("--prompt", help="extra instruction, e.g. a task description")
    encode.add_argument("--batch-size", type=int, default=16)
    encode.add_argument("--device", help="torch device, e.g. cpu or cuda")
    encode.add_argument("--json", action="store_true", help="print JSON: texts, rationales, embeddings, similarities")
    _encoder_options(encode)

    build = commands.add_parser("build", help="wrap a chat causal LM as a GRACE sentence-transformers model")
    build.add_argument("--base", required=True, help="causal LM directory or Hub id")
    build.add_argument("--out", required=True, help="output directory")
    build.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16, float16 or auto")
    build.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code")
    _encoder_options(build)
    return parser


def _read_texts(arguments: list[str]) -> list[str]:
    if arguments == ["-"]:
        return [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if "-" in arguments:
        raise SystemExit("grace-st encode: '-' must be the only text argument")
    return arguments


def run_encode(args: argparse.Namespace) -> int:
    from sentence_transformers import SentenceTransformer

    from . import default_model_path, explain

    texts = _read_texts(args.texts)
    if not texts:
        raise SystemExit("grace-st encode: no texts to encode")
    model = SentenceTransformer(args.model or default_model_path(), device=args.device, trust_remote_code=True)
    encoder = model[0]
    for name, value in _encoder_settings(args).items():
        if name == "instructions":
            encoder.instructions.update(value)
        else:
            setattr(encoder, name, value)
    encoder.check_settings()
    items = explain(
        model,
        texts,
        batch_size=args.batch_size,
        task=args.task,
        prompt=args.prompt,
        show_progress_bar=len(texts) > args.batch_size,
    )
    embeddings = np.stack([item["embedding"] for item in items])
    similarity = model.similarity(embeddings, embeddings).numpy()
    if args.json:
        payload = {
            "texts": texts,
            "rationales": [item["rationale"] for item in items],
            "truncated": [item["truncated"] for item in items],
            "embeddings": embeddings.tolist(),
            "similarity": similarity.tolist(),
        }
        json.dump(payload, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for index, item in enumerate(items):
        cut = " [cut at the length limit]" if item["truncated"] else ""
        print(f"[{index}] {item['text']}\n    rationale{cut}: {item['rationale'].strip()}\n")
    print("cosine similarity")
    print("      " + " ".join(f"[{j}]".rjust(6) for j in range(len(texts))))
    for i, row in enumerate(similarity):
        print(f"[{i}]".ljust(6) + " ".join(f"{value:6.3f}" for value in row))
    return 0


def run_build(args: argparse.Namespace) -> int:
    import torch

    from . import from_causal_lm
    from .model_cards import write_model_card

    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = from_causal_lm(
        args.base,
        model_kwargs={"dtype": dtype, "trust_remote_code": args.trust_remote_code},
        tokenizer_kwargs={"trust_remote_code": args.trust_remote_code},
        **_encoder_settings(args),
    )
    model.save(args.out)
    write_model_card(model, args.out, model_id=args.out, base_model=args.base)
    print(f"saved a GRACE model ({model[0].get_embedding_dimension()}-d) to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_encode(args) if args.command == "encode" else run_build(args)


if __name__ == "__main__":
    raise SystemExit(main())
