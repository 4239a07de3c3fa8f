"""`dynaplane data prepare` against `datasets` + `tokenizers` used directly, on the same JSONL of
the Python standard library's source (one file a row) and the same BPE tokenizer.json (vocab 8,192,
trained here on that text): input MB per second, each run in the same process, each into a fresh
directory (the baseline's Arrow cache included: `load_dataset("json")` then a batched `map` calling
the tokenizer's `encode_batch`, the pipeline a user writes by hand; it leaves token lists in Arrow,
ours a Megatron .bin/.idx).

    .venv/bin/python -m benchmarks.data_prepare [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path


def _corpus(tmp: Path) -> tuple[Path, Path, int]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace")
             for p in sorted(lib.rglob("*.py")) if "site-packages" not in p.parts]
    jsonl = tmp / "stdlib.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[::4], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp / "tokenizer.json"))
    return jsonl, tmp / "tokenizer.json", jsonl.stat().st_size


def ours(jsonl: Path, tokenizer: Path, out: Path) -> tuple[float, int]:
    from parallelism.datasets.prepare import prepare
    from parallelism.datasets.tokenizer import HFTokenizer

    started = time.perf_counter()
    result = prepare([jsonl], out, HFTokenizer(tokenizer), progress=False)
    return time.perf_counter() - started, result.tokens


def baseline(jsonl: Path, tokenizer: Path, cache: Path) -> tuple[float, int]:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    started = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer))
    ds = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(cache))
    ds = ds.map(lambda batch: {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]},
                batched=True, remove_columns=["text"])
    tokens = sum(len(r) for r in ds["ids"])
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        jsonl, tokenizer, size = _corpus(tmp)
        print(f"input: {size / 1e6:.1f} MB of JSONL ({sum(1 for _ in open(jsonl))} rows), BPE vocab 8,192")
        times = {"ours": [], "datasets": []}
        for r in range(args.repeat):
            t, ours_tokens = ours(jsonl, tokenizer, tmp / f"ours-{r}")
            times["ours"].append(t)
            t, base_tokens = baseline(jsonl, tokenizer, tmp / f"cache-{r}")
            times["datasets"].append(t)
        eos = ours_tokens - base_tokens  # ours ends every document with <|endoftext|>
        for kind, ts in times.items():
            print(f"{kind:>9}: median {statistics.median(ts):.2f} s ({size / 1e6 / statistics.median(ts):.1f} MB/s) "
                  f"over {args.repeat} runs: {', '.join(f'{t:.2f}' for t in ts)}")
        ratio = statistics.median(times["datasets"]) / statistics.median(times["ours"])
        print(f"tokens: ours {ours_tokens:,} (with {eos:,} end-of-document tokens), datasets {base_tokens:,}")
        print(f"RESULT: prepare runs at {ratio:.2f}x the MB/s of datasets + tokenizers used directly")


if __name__ == "__main__":
    main()
