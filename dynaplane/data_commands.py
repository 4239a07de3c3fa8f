"""`dynaplane data ...`: prepare a dataset from text, JSONL or Parquet; describe one; and, through
a running control plane's API, register one that lies under its data root and list them."""
from __future__ import annotations

import argparse
import json
import os
import sys

from dynaplane.api_client import ApiError, api, api_arguments


def add_data_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="datasets: prepare text into tokens, describe, register and list datasets")
    verbs = data.add_subparsers(dest="data_command", required=True)
    p = verbs.add_parser("prepare", help="tokenize text, JSONL or Parquet into a Megatron indexed dataset")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories (searched recursively)")
    p.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to write")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON", default=None,
                   help="a Hugging Face tokenizer.json (default: bytes, vocab 257)")
    p.add_argument("--eos-token", default=None, help="the token that ends each document (default: the tokenizer's)")
    p.add_argument("--validation-fraction", type=float, default=0.01,
                   help="share of documents held out for validation (default 0.01)")
    p.add_argument("--text-field", default="text", help="the JSONL field / Parquet column holding text")
    p.add_argument("--name", default=None, help="the dataset's name (default: the directory's)")
    p.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_prepare)
    d = verbs.add_parser("describe", help="check a dataset directory and print what it holds")
    d.add_argument("directory", help="the dataset's folder (as `dynaplane data prepare` wrote it)")
    d.add_argument("--seq", type=int, default=2048, help="sequence length to count samples for")
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.set_defaults(func=_describe)
    r = verbs.add_parser("register", help="register a dataset directory under the control plane's data root")
    r.add_argument("directory", metavar="DIR",
                   help="the dataset directory: relative to the data root (DYNAPLANE_DATA_ROOT), or a directory "
                        "here inside it (sent as its absolute path)")
    r.add_argument("--name", default="", help="the dataset's name (default: the manifest's, else the directory's)")
    api_arguments(r)
    r.set_defaults(func=_register)
    ls = verbs.add_parser("list", help="list the datasets the control plane has registered")
    api_arguments(ls)
    ls.set_defaults(func=_list)


def _register(args: argparse.Namespace) -> int:
    directory = args.directory
    if os.path.isdir(directory):  # a directory of this machine: the server checks it lies under its data root
        directory = os.path.abspath(directory)
    try:
        row = api(args, "POST", "api/datasets", {"path": directory, "name": args.name})
    except ApiError as exc:
        print(f"dynaplane data register: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(row))
    else:
        print(f"registered {row['name']} (id {row['id']}): {row['path']} under the data root, {row['format']}, "
              f"{row['documents']:,} documents, {row['tokens']:,} tokens, vocab {row['vocab_size']:,} "
              f"({row['tokenizer']}), validation {row['validation_fraction']:g} of the documents")
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        rows = api(args, "GET", "api/datasets?limit=1000")["results"]
    except (ApiError, KeyError, TypeError) as exc:
        print(f"dynaplane data list: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no datasets registered (`dynaplane data register DIR`)")
        return 0
    print(f"{'id':>4} {'name':24} {'tokens':>14} {'documents':>10} {'vocab':>8} {'tokenizer':10} {'validation':>10} "
          f"{'jobs':>5}  path")
    for r in rows:
        print(f"{r['id']:>4} {r['name']:24} {r['tokens']:>14,} {r['documents']:>10,} {r['vocab_size']:>8,} "
              f"{r['tokenizer']:10} {r['validation_fraction']:>10g} {len(r['jobs']):>5}  {r['path']}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from parallelism.datasets.errors import DatasetError
    from parallelism.datasets.prepare import prepare
    from parallelism.datasets.tokenizer import HFTokenizer

    try:
        tokenizer = HFTokenizer(args.tokenizer, args.eos_token) if args.tokenizer else None
        result = prepare(args.inputs, args.out, tokenizer, validation_fraction=args.validation_fraction,
                         name=args.name, text_field=args.text_field, force=args.force, progress=not args.quiet)
    except DatasetError as exc:
        print(f"dynaplane data prepare: {exc}", file=sys.stderr)
        return 2
    m = result.manifest
    summary = {"directory": str(result.directory), "documents": result.documents, "skipped": result.skipped,
               "tokens": result.tokens, "input_bytes": result.input_bytes, "seconds": round(result.seconds, 3),
               "mb_per_second": round(result.mb_per_second, 2),
               "tokens_per_second": round(result.tokens / max(result.seconds, 1e-9)),
               "vocab_size": m.vocab_size, "fingerprint": m.fingerprint}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"prepared {result.directory}: {result.documents} documents ({result.skipped} empty skipped), "
              f"{result.tokens:,} tokens, vocab {m.vocab_size}, from {result.input_bytes / 1e6:.1f} MB in "
              f"{result.seconds:.2f} s: {summary['mb_per_second']} MB/s, {summary['tokens_per_second']:,} tokens/s")
    return 0


def _describe(args: argparse.Namespace) -> int:
    from parallelism.datasets.describe import describe
    from parallelism.datasets.errors import DatasetError

    try:
        info = describe(args.directory, args.seq)
    except DatasetError as exc:
        print(f"dynaplane data describe: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>22}: {value}")
    return 0
