"""``grace-st``: encode texts with their rationales, or build a GRACE model from a causal LM."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

import numpy as np

from grace_st.prompts import text_problem
from grace_st.settings import SETTINGS, cli_flag


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, at least 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _budget(text: str) -> int | dict[str, int]:
    """``64``, or ``query=64,document=0`` (a budget by prompt type)."""
    try:
        if "=" not in text:
            return int(text)
        pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
        return {kind.strip(): int(value) for kind, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an integer nor TYPE=N pairs (query=64,document=0)"
        ) from None


_CLI_TYPES = {"int": int, "float": float, "per_type": _budget}


def _encoder_options(parser: argparse.ArgumentParser) -> None:
    """An option for each setting that has one (:data:`grace_st.settings.SETTINGS`: its help is the
    setting's), and the three instructions."""
    group = parser.add_argument_group("encoder options (the model's own settings unless given)")
    for name, setting in SETTINGS.items():
        if setting.cli == "flag":
            group.add_argument(cli_flag(name), action="store_true", default=None, help=setting.help)
        elif setting.cli == "choice":
            group.add_argument(cli_flag(name), choices=setting.choices, help=setting.help)
        elif setting.cli is not None:
            per_type = setting.cli == "per_type"
            group.add_argument(
                cli_flag(name),
                type=_CLI_TYPES[setting.cli],
                metavar="N|TYPE=N,..." if per_type else None,
                help=setting.help
                + (
                    "; TYPE=N,... (e.g. query=64,document=0) sets those types, others keep the model's"
                    if per_type
                    else ""
                ),
            )
    group.add_argument("--instruction", help="the default instruction")
    group.add_argument("--query-instruction")
    group.add_argument("--document-instruction")


def _encoder_settings(args: argparse.Namespace) -> dict:
    names = [name for name, setting in SETTINGS.items() if setting.cli_option]
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


def _load_model(path: str, args: argparse.Namespace):
    """Load a model and apply the encoder options given on the command line (a GRACE model's
    GenerativeEncoder settings; other sentence-transformers models take none)."""
    from grace_st.files.loading import load

    model = load(
        path,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        model_kwargs=getattr(args, "model_kwargs", None),
    )
    encoder = model[0]
    settings = _encoder_settings(args)
    if settings and not hasattr(encoder, "override_settings"):
        raise SystemExit(f"grace-st: {path} is not a GRACE model; encoder options do not apply to it")
    if hasattr(encoder, "override_settings"):
        encoder.override_settings(settings)
    return model


# The similarity matrix is N × N: shown by default only for a handful of texts (6,000 lines of stdin
# would make a 36-million-entry matrix, hundreds of MB of JSON); --similarity asks for it at any N.
SIMILARITY_MAX_TEXTS = 32

TRUST_HELP = (
    "run Python code that ships with the model (a module class of its own in modules.json, an "
    "auto_map in its config); without it such a model is refused, naming the file"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grace-st", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_encode_command(commands)
    _add_build_command(commands)
    _add_eval_command(commands)
    _add_serve_command(commands)
    _add_memory_commands(commands)
    _add_encode_corpus_command(commands)
    return parser


def _add_encode_command(commands) -> None:
    """``grace-st encode``: texts in, rationales and embeddings (and their similarities) out."""
    encode = commands.add_parser(
        "encode",
        help=f"print each text's rationale, then the cosine similarity matrix (up to {SIMILARITY_MAX_TEXTS} texts, "
        "or with --similarity)",
    )
    encode.add_argument("texts", nargs="+", help="texts to encode; '-' reads one text a line from stdin")
    encode.add_argument("--model", help="GRACE model directory or Hub id (default: the embedded default model)")
    encode.add_argument("--task", choices=["query", "document"], help="use the query or document instruction")
    encode.add_argument("--prompt", help="extra instruction, e.g. a task description")
    encode.add_argument("--batch-size", type=_positive_int, default=16)
    encode.add_argument("--device", help="torch device, e.g. cpu or cuda")
    encode.add_argument(
        "--json",
        action="store_true",
        help="print JSON: texts, rationales, embeddings, and the similarities when they are shown",
    )
    encode.add_argument(
        "--similarity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"the N × N cosine similarity matrix (default: shown for up to {SIMILARITY_MAX_TEXTS} texts; its memory "
        "and output grow with N², --similarity shows it for more, --no-similarity never)",
    )
    encode.add_argument("--cache", help="a rationale cache file (SQLite): repeated texts skip generation")
    encode.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    _encoder_options(encode)


def _add_build_command(commands) -> None:
    """``grace-st build``: a causal LM wrapped and saved as a GRACE model."""
    build = commands.add_parser("build", help="wrap a chat causal LM as a GRACE sentence-transformers model")
    build.add_argument("--base", required=True, help="causal LM directory or Hub id")
    build.add_argument("--out", required=True, help="output directory")
    build.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16, float16 or auto")
    build.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    _encoder_options(build)


def _add_eval_command(commands) -> None:
    """``grace-st eval``: local task files and registered MTEB tasks, scored into a table."""
    evaluate = commands.add_parser(
        "eval", help="run mteb on local task files (and registered MTEB tasks when online); print a table"
    )
    evaluate.add_argument("model", help="GRACE model directory or Hub id")
    local = evaluate.add_argument_group("local tasks (each option may be repeated)")
    local.add_argument("--sts", action="append", default=[], metavar="FILE", help="table: score sentence1 sentence2")
    local.add_argument("--beir", action="append", default=[], metavar="DIR", help="corpus.jsonl, queries.jsonl, qrels/")
    local.add_argument("--beir-split", metavar="SPLIT", help="qrels split (default: test, or the folder's only one)")
    local.add_argument("--classification", action="append", default=[], metavar="FILE", help="table: text,label")
    local.add_argument("--pairs", action="append", default=[], metavar="FILE", help="table: label sentence1 sentence2")
    evaluate.add_argument("--tasks", nargs="+", default=[], metavar="NAME", help="registered MTEB tasks (Hub data)")
    evaluate.add_argument("--limit", type=_positive_int, help="at most N pairs / test texts / queries per local task")
    evaluate.add_argument(
        "--corpus-limit", type=_positive_int, help="retrieval: relevant documents plus a sample, N in all"
    )
    evaluate.add_argument("--batch-size", type=_positive_int, default=16)
    evaluate.add_argument("--device", help="torch device, e.g. cpu or cuda")
    evaluate.add_argument("--output", metavar="FILE", help="write the results as JSON")
    evaluate.add_argument("--cache-dir", help="mteb result cache (default: $GRACE_ST_HOME/mteb, else the temp dir)")
    evaluate.add_argument(
        "--overwrite-strategy",
        default="always",
        choices=["always", "only-missing"],
        help="'always' (default) re-runs every task; 'only-missing' reuses cached results of any model "
        "with the same mteb name and revision",
    )
    evaluate.add_argument("--no-progress", action="store_true", help="hide progress bars")
    evaluate.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    _encoder_options(evaluate)


def _add_memory_commands(commands) -> None:
    """``grace-st compress`` and ``grace-st ask``: a GRC model's compressed memories (docs/grc.md)."""
    compress = commands.add_parser(
        "compress", help="a GRC model: each text's latent memory (keys and values of its latent tokens) to a file"
    )
    compress.add_argument("texts", nargs="+", help="texts to compress; '-' reads one text a line from stdin")
    compress.add_argument("--model", required=True, help="a GRC model directory or Hub id (method 'grc')")
    compress.add_argument(
        "--out", required=True,
        help="the memory file written (safetensors): a new file outside any model's folder, unless --overwrite",
    )
    compress.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    compress.add_argument(
        "--keep-texts", action="store_true",
        help="also store the texts in the file's metadata (by default the file holds the memories, not the texts)",
    )
    compress.add_argument("--batch-size", type=_positive_int, default=16)
    compress.add_argument("--device", help="torch device, e.g. cpu or cuda")
    compress.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    ask = commands.add_parser("ask", help="a GRC model answers a question, reading memories made by compress")
    ask.add_argument("question", help="the question")
    ask.add_argument("--model", required=True, help="the GRC model the memories were made with")
    ask.add_argument(
        "--memory", action="append", default=[],
        help="a memory file from grace-st compress (repeat for several; every memory in each file is read, in order)",
    )
    ask.add_argument("--max-new-tokens", type=_positive_int, default=128)
    ask.add_argument("--device", help="torch device, e.g. cpu or cuda")
    ask.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)


def _add_encode_corpus_command(commands) -> None:
    """``grace-st encode-corpus``: a JSONL or Parquet corpus to Parquet shards of embeddings, on Ray Data."""
    from grace_st.corpus import BAD_ROW_POLICIES, DTYPES, PROMPT_TYPES, SKIPPED_REPORT

    corpus = commands.add_parser(
        "encode-corpus",
        help="embed every row of a JSONL or Parquet corpus into Parquet shards, on Ray Data (a local Ray, or a "
        "cluster by --address); resumable; needs grace-st[distributed]",
    )
    corpus.add_argument("input", help="a .jsonl/.json (JSON Lines) or .parquet file, or a folder of them")
    corpus.add_argument("output", help="a folder of Parquet shards (a run on it again writes only missing ids)")
    corpus.add_argument("--model", help="GRACE model directory or Hub id (default: the embedded default model)")
    corpus.add_argument("--text-column", default="text")
    corpus.add_argument("--id-column", default="id", help="the ids, each once (strings or integers; default: id)")
    corpus.add_argument("--make-ids", action="store_true", help="number the rows (0, 1, ... in file order) as ids")
    corpus.add_argument("--prompt-type", choices=PROMPT_TYPES, default="document",
                        help="document (encode_document, the default), query (encode_query) or default (encode)")
    corpus.add_argument("--batch-size", type=_positive_int, default=16, help="texts an actor encodes a call")
    corpus.add_argument("--actors", type=_positive_int, default=1, help="actors, each holding the model (default 1)")
    corpus.add_argument("--threads-per-actor", type=_positive_int,
                        help="CPUs (torch threads) an actor (default: the CPUs shared among the actors)")
    corpus.add_argument("--gpus-per-actor", type=float, default=0, help="GPUs an actor (e.g. 1, or 0.5 for two a GPU)")
    corpus.add_argument("--address", help="join a running Ray cluster: auto or ray://HOST:PORT (default: "
                        "RAY_ADDRESS or a `ray start` cluster on this machine, else a local Ray for the command)")
    corpus.add_argument("--limit", type=_positive_int, help="the first N rows of the corpus only")
    corpus.add_argument("--on-bad-row", choices=BAD_ROW_POLICIES, default="fail",
                        help="fail (default): any bad row stops the run before any model work; skip: leave bad rows "
                        "out and list them in the report")
    corpus.add_argument("--bad-row-report", metavar="FILE", help=f"the skipped rows (default: OUTPUT/{SKIPPED_REPORT})")
    corpus.add_argument("--truncate", action="store_true",
                        help="embed a text over the model's input limit cut at the limit, as encode does "
                        "(without it such a text is a bad row)")
    corpus.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the stored embedding: float32 (default), float16, or int8 with a per-row scale")
    corpus.add_argument("--rationale", action="store_true", help="store each text's rationale too")
    corpus.add_argument("--overwrite", action="store_true", help="replace an OUTPUT written with another model or "
                        "settings (without it such an OUTPUT is refused)")
    corpus.add_argument("--rows-per-shard", type=_positive_int, default=256,
                        help="rows a block and a Parquet shard at most: the unit of work a rerun can redo")
    corpus.add_argument("--device", help="torch device in each actor (default: cuda with --gpus-per-actor, else cpu)")
    corpus.add_argument("--no-progress", action="store_true", help="hide Ray Data's progress bars")
    corpus.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    _encoder_options(corpus)


def _add_serve_command(commands) -> None:
    """``grace-st serve``: the OpenAI-compatible embedding server and its limits."""
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible embedding server (POST /v1/embeddings); needs grace-st[server]"
    )
    serve.add_argument("model", nargs="?", help="GRACE model directory or Hub id (default: the embedded default model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $GRACE_ST_API_KEY; none when unset; an empty key is an error, from either)",
    )
    serve.add_argument(
        "--model-name", help="the model's name in the API (default: MODEL as given, or grace-st-default)"
    )
    serve.add_argument("--max-texts", type=_positive_int, default=2048, help="texts a request at most (413 over)")
    serve.add_argument("--max-chars", type=_positive_int, default=32_768, help="characters a text at most (413 over)")
    serve.add_argument(
        "--max-queue",
        type=_positive_int,
        default=1024,
        help="texts waiting or decoding at most; a request over it gets 429 with Retry-After",
    )
    serve.add_argument(
        "--max-queue-chars",
        type=_positive_int,
        default=8 * 1024 * 1024,
        help="characters of the texts waiting or decoding at most (429 over; 413 for a request over it alone)",
    )
    serve.add_argument("--slots", type=_positive_int, default=32, help="rows decoded together at most")
    serve.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=64.0,
        help="MiB for the instruction prefixes' keys and values, computed once and kept across requests "
        "(default 64, grace_st.runtime.prefix_cache's bound; 0: off, every prompt pass computes its whole prompt)",
    )
    serve.add_argument(
        "--prompt-pass-tokens",
        type=_positive_int,
        default=2048,
        help="prompt tokens a decoding step reads at most (at least one prompt): bounds how long a step holds "
        "the model, so a request whose client left is dropped within one",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long the requests in flight may take to finish; then each is answered 503",
    )
    serve.add_argument("--weight-quantization", choices=["int8"], help="int8 weight-only quantization at load")
    serve.add_argument("--device", help="torch device, e.g. cpu or cuda")
    serve.add_argument("--cache", help="a rationale cache file (SQLite), shared by every request")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    _encoder_options(serve)


def _stdin_lines(command: str = "encode") -> list[str]:
    """One text a line, every line: a blank line is an empty text, so output row i is input line
    i + 1. CRLF and LF endings alike, invalid UTF-8 named by line. Read a line at a time under the
    data files' limits (``grace_st.data.files``: 8 MiB a line, 1 GiB in all), so ``/dev/zero``
    or a binary file ends in an error, not in memory exhaustion."""
    from grace_st.data.files import bounded_lines

    stream = (
        sys.stdin.buffer
        if hasattr(sys.stdin, "buffer")
        else io.BytesIO(sys.stdin.read().encode("utf-8", "surrogateescape"))
    )
    texts = []
    for number, raw in bounded_lines("stdin", stream):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise SystemExit(
                f"grace-st {command}: stdin line {number} is not valid UTF-8 (byte {raw[error.start]:#04x} at "
                f"column {error.start + 1}); convert the input, e.g. iconv -f latin1 -t utf-8"
            ) from None
        line = line.removeprefix("\ufeff") if number == 1 else line
        texts.append(line.removesuffix("\n").removesuffix("\r"))
    return texts


def _read_texts(arguments: list[str], command: str = "encode") -> list[str]:
    if arguments == ["-"]:
        return _stdin_lines(command)
    if "-" in arguments:
        raise SystemExit(f"grace-st {command}: '-' must be the only text argument")
    for index, text in enumerate(arguments, start=1):
        if text_problem(text) is not None:  # argv bytes that were not UTF-8 arrive as lone surrogates
            raise SystemExit(f"grace-st {command}: text argument {index} is not valid UTF-8: {text!r:.80}")
    return arguments


def run_encode(args: argparse.Namespace) -> int:
    from grace_st import default_model_path, explain

    texts = _read_texts(args.texts)
    if not texts:
        raise SystemExit("grace-st encode: no texts to encode")
    model = _load_model(args.model or default_model_path(), args)
    encoder = model[0]
    if args.cache:
        encoder.set_rationale_cache(args.cache)
    items = explain(
        model,
        texts,
        batch_size=args.batch_size,
        task=args.task,
        prompt=args.prompt,
        show_progress_bar=len(texts) > args.batch_size,
    )
    embeddings = np.stack([item["embedding"] for item in items])
    shown = args.similarity if args.similarity is not None else len(texts) <= SIMILARITY_MAX_TEXTS
    similarity = model.similarity(embeddings, embeddings).numpy() if shown else None
    if args.json:
        payload = {
            "texts": texts,
            "rationales": [item["rationale"] for item in items],
            "truncated": [item["truncated"] for item in items],
            "rationale_budgets": [item["rationale_budget"] for item in items],
            "embeddings": embeddings.tolist(),
            **({"similarity": similarity.tolist()} if shown else {}),
        }
        json.dump(payload, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for index, item in enumerate(items):
        cut = ", cut at the limit" if item["truncated"] else ""
        print(
            f"[{index}] {item['text']}\n"
            f"    rationale ({item['rationale_budget']} tokens max{cut}): {item['rationale'].strip()}\n"
        )
    if not shown:
        print(f"({len(texts)} texts: no similarity matrix over {SIMILARITY_MAX_TEXTS} texts; --similarity prints it)")
        return 0
    print("cosine similarity")
    print("      " + " ".join(f"[{j}]".rjust(6) for j in range(len(texts))))
    for i, row in enumerate(similarity):
        print(f"[{i}]".ljust(6) + " ".join(f"{value:6.3f}" for value in row))
    return 0


def run_build(args: argparse.Namespace) -> int:
    import torch

    from grace_st import from_causal_lm
    from grace_st.model_cards import write_model_card

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


def _check_writable(path: str, where: str = "grace-st eval: --output") -> None:
    """Refuse an output file that cannot be written before the work, not after it: opened for
    appending (the file is untouched) and removed again when the check created it."""
    if os.path.isdir(path):
        raise SystemExit(f"{where} {path} is a directory; give a file name")
    existed = os.path.lexists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise SystemExit(f"{where} {path} cannot be written ({error.strerror or error})") from None
    if not existed:
        os.remove(path)


def run_eval(args: argparse.Namespace) -> int:
    from grace_st.evaluation.runner import default_cache_dir

    # mteb creates its default cache folder when imported; point it at ours first.
    cache_dir = args.cache_dir or str(default_cache_dir())
    os.environ.setdefault("MTEB_CACHE", cache_dir)
    from grace_st.evaluation import DataFileError, format_table, run_evaluation
    from grace_st.evaluation import local_tasks as local

    try:
        tasks = (
            [local.sts_task(path, limit=args.limit) for path in args.sts]
            + [
                local.retrieval_task(path, args.beir_split, limit=args.limit, corpus_limit=args.corpus_limit)
                for path in args.beir
            ]
            + [local.classification_task(path, limit=args.limit) for path in args.classification]
            + [local.pair_classification_task(path, limit=args.limit) for path in args.pairs]
        )
        names = [task.metadata.name for task in tasks]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"two local tasks are both named {', '.join(duplicates)}: give files distinct names")
        for task in tasks:  # malformed files stop here, before the model is loaded
            task.load_data()
    except (DataFileError, OSError, ValueError) as error:
        raise SystemExit(f"grace-st eval: {error}") from None
    if not tasks and not args.tasks:
        raise SystemExit("grace-st eval: nothing to evaluate; give --sts, --beir, --classification, --pairs or --tasks")
    if args.output:
        _check_writable(args.output)

    model = _load_model(args.model, args)
    encoder = model[0]
    if hasattr(encoder, "describe_for_mteb"):  # the revision mteb reports must follow the overrides
        encoder.describe_for_mteb(model)
    report = run_evaluation(
        model,
        tasks,
        args.tasks,
        batch_size=args.batch_size,
        cache_dir=cache_dir,
        overwrite_strategy=args.overwrite_strategy,
        show_progress_bar=not args.no_progress,
    )
    report["model"]["path"] = args.model
    print(format_table(report))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
        print(f"results written to {args.output}")
    return 1 if any(entry["error"] for entry in report["tasks"]) else 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        from grace_st.serve.server import Limits, api_key_from, serve
    except ImportError as error:
        raise SystemExit(f"grace-st serve: {error.name} is missing: pip install 'grace-st[server]'") from None
    from grace_st import default_model_path

    try:  # before the model loads: a key no client could send is a usage error, as argparse's are (exit 2)
        api_key = api_key_from(args.api_key)
    except ValueError as error:
        print(f"grace-st serve: error: {error}", file=sys.stderr)
        return 2

    if args.weight_quantization:
        args.model_kwargs = {"weight_quantization": args.weight_quantization}
    model = _load_model(args.model or default_model_path(), args)
    if args.cache:
        model[0].set_rationale_cache(args.cache)
    _size_prefix_cache(model, args.prefix_cache_mb)
    serve(
        model,
        model_name=args.model_name or args.model or "grace-st-default",
        host=args.host,
        port=args.port,
        api_key=api_key,
        limits=Limits(max_texts=args.max_texts, max_chars=args.max_chars),
        max_queued_texts=args.max_queue,
        max_queued_chars=args.max_queue_chars,
        max_slots=args.slots,
        prompt_pass_tokens=args.prompt_pass_tokens,
        shutdown_grace=args.shutdown_grace,
        log_level=args.log_level,
    )
    return 0


def _size_prefix_cache(model, megabytes: float) -> None:
    """``--prefix-cache-mb``: the store's bound, or (0) the cache off."""
    import dataclasses

    from grace_st.runtime.prefix_cache import PREFIX_STORE

    if megabytes < 0:
        raise SystemExit(f"grace-st serve: error: --prefix-cache-mb must be >= 0, got {megabytes}")
    PREFIX_STORE.resize(int(megabytes * 2**20))
    if megabytes == 0:
        model[0].decode_options = dataclasses.replace(model[0].decode_options, prefix_cache=False)


def _load_grc_model(args: argparse.Namespace):
    """The model as saved: a memory is read by the model (and settings) that made it."""
    from grace_st.files.loading import load

    return load(args.model, device=args.device, trust_remote_code=args.trust_remote_code)


def run_compress(args: argparse.Namespace) -> int:
    from grace_st.memory import compress
    from grace_st.methods.grc import check_memory_out, save_memories

    texts = _read_texts(args.texts, "compress")
    if not texts:
        raise SystemExit("grace-st compress: no texts to compress")
    check_memory_out(args.out, args.overwrite)  # before the work, not after it
    memories = compress(_load_grc_model(args), texts, batch_size=args.batch_size)
    save_memories(args.out, memories, texts=texts if args.keep_texts else None, overwrite=args.overwrite)
    size = memories[0].nbytes
    print(f"{len(memories)} memories of {size:,} bytes each ({size * len(memories):,} in all) to {args.out}")
    return 0


def run_ask(args: argparse.Namespace) -> int:
    from grace_st.memory import answer
    from grace_st.methods.grc import load_memories

    memories = [memory for path in args.memory for memory in load_memories(path)]  # checked before the model loads
    print(answer(_load_grc_model(args), args.question, memories, max_new_tokens=args.max_new_tokens))
    return 0


def run_encode_corpus(args: argparse.Namespace) -> int:
    from grace_st.corpus import encode_corpus

    summary = encode_corpus(
        args.input, args.output, model=args.model, text_column=args.text_column, id_column=args.id_column,
        make_ids=args.make_ids, prompt_type=args.prompt_type, batch_size=args.batch_size, actors=args.actors,
        threads_per_actor=args.threads_per_actor, gpus_per_actor=args.gpus_per_actor, address=args.address,
        limit=args.limit, on_bad_row=args.on_bad_row, bad_row_report=args.bad_row_report, truncate=args.truncate,
        dtype=args.dtype, rationale=args.rationale, overwrite=args.overwrite, rows_per_shard=args.rows_per_shard,
        settings=_encoder_settings(args), device=args.device, trust_remote_code=args.trust_remote_code,
        progress=not args.no_progress,
    )
    actors = (
        f" with {summary['actors']} actor{'s' if summary['actors'] > 1 else ''} x {summary['threads_per_actor']} "
        f"thread{'s' if summary['threads_per_actor'] > 1 else ''}"
        + (f" and {summary['gpus_per_actor']:g} GPU" if summary["gpus_per_actor"] else "")
        if summary["actors"] else " (nothing left to encode: no model loaded)"
    )
    print(
        f"encoded {summary['encoded']:,} texts in {summary['seconds']:.1f} s ({summary['texts_per_second']:.2f} "
        f"texts/s){actors}; {summary['already_done']:,} already done, {summary['skipped']:,} skipped"
        + (f" (listed in {summary['bad_row_report']})" if summary["bad_row_report"] else "")
        + (f", {summary['incomplete_shards_removed']} incomplete shards removed"
           if summary["incomplete_shards_removed"] else "")
    )
    extra = summary["ids_in_output_not_in_input"]
    print(f"output: {summary['output']} ({summary['output_rows']:,} rows"
          + (f"; {extra:,} of its ids are not in INPUT" if extra else "") + ")")
    return 0


COMMANDS = {
    "encode": run_encode, "build": run_build, "eval": run_eval, "serve": run_serve, "compress": run_compress,
    "ask": run_ask, "encode-corpus": run_encode_corpus,
}


def main(argv: list[str] | None = None) -> int:
    """Run a command. An error ends in one line naming the problem and exit status 1 (2 for a memory file that
    cannot be read or written, bad input as a bad option is), never a traceback (``GRACE_ST_DEBUG=1`` shows it)."""
    args = build_parser().parse_args(argv)
    from grace_st.methods.grc import MemoryFileError

    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"grace-st {args.command}: interrupted", file=sys.stderr)
        return 130
    except MemoryFileError as error:
        if os.environ.get("GRACE_ST_DEBUG"):
            raise
        print(f"grace-st {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if os.environ.get("GRACE_ST_DEBUG"):
            raise
        kind = "" if isinstance(error, (ValueError, OSError)) else f"{type(error).__name__}: "
        print(f"grace-st {args.command}: error: {kind}{error}", file=sys.stderr)
        print("(set GRACE_ST_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
