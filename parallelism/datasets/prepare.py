"""`dynaplane data prepare`: text, JSONL or Parquet in, a Megatron indexed dataset out.

Inputs are files or directories (searched recursively). A `.jsonl` line or a Parquet row is one
document (its `text` field, or --text-field); any other file is one document (UTF-8, undecodable
bytes replaced). Documents are tokenized in batches (the `tokenizers` batch encoder runs on every
core), each followed by the end-of-document token, and written as PREFIX.bin/.idx with a manifest
(parallelism/datasets/manifest.py); empty documents are skipped and counted.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from parallelism.datasets.errors import DatasetError
from parallelism.datasets.indexed import IndexedWriter, token_dtype
from parallelism.datasets.manifest import MANIFEST, Manifest, file_digest, write_manifest

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text", ".html", ".c", ".h", ".json")
BATCH_BYTES = 1 << 20  # texts handed to the tokenizer at once


@dataclass(frozen=True)
class PrepareResult:
    directory: Path
    documents: int
    skipped: int
    tokens: int
    input_bytes: int
    seconds: float
    manifest: Manifest

    @property
    def mb_per_second(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


def input_files(inputs: list[str | Path]) -> list[Path]:
    """Every input file, directories expanded (sorted, so the document order is reproducible)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and
                           (p.suffix in (".jsonl", ".parquet") or p.suffix in TEXT_SUFFIXES))
            if not found:
                raise DatasetError(f"{path.name}: a directory with no .txt/.md/.py/.jsonl/.parquet files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DatasetError(f"{path.name}: no such file or directory")
    return files


def documents(files: list[Path], text_field: str = "text",
              on_bytes: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """Each document's text, in order; `on_bytes` hears how much input was read."""
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    on_bytes(len(line))
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        raise DatasetError(f"{path.name}: line {number} is not JSON") from None
                    text = row.get(text_field) if isinstance(row, dict) else None
                    if not isinstance(text, str):
                        raise DatasetError(f"{path.name}: line {number} has no string field {text_field!r}")
                    yield text
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.ParquetFile(path)
            except Exception as exc:  # pyarrow's ArrowInvalid and friends
                raise DatasetError(f"{path.name}: not a Parquet file ({type(exc).__name__})") from None
            if text_field not in table.schema_arrow.names:
                raise DatasetError(f"{path.name}: has no column {text_field!r} "
                                   f"(columns: {', '.join(table.schema_arrow.names)})")
            size, rows = path.stat().st_size, max(1, table.metadata.num_rows)
            for batch in table.iter_batches(columns=[text_field], batch_size=1024):
                on_bytes(size * batch.num_rows // rows)
                yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))
        else:
            data = path.read_bytes()
            on_bytes(len(data))
            yield data.decode("utf-8", errors="replace")


def prepare(inputs: list[str | Path], out: str | Path, tokenizer=None, *, validation_fraction: float = 0.01,
            name: str | None = None, text_field: str = "text", force: bool = False,
            progress: bool = True) -> PrepareResult:
    """Tokenize `inputs` into the dataset directory `out` (created; refused if it holds a dataset, unless force)."""
    from parallelism.datasets.tokenizer import ByteTokenizer, HFTokenizer

    started = time.perf_counter()
    tokenizer = tokenizer or ByteTokenizer()
    if not 0 <= validation_fraction < 1:
        raise DatasetError(f"--validation-fraction {validation_fraction} must be in [0, 1)")
    out = Path(out)
    if (out / MANIFEST).exists() and not force:
        raise DatasetError(f"{out.name}: already holds a dataset ({MANIFEST}); --force replaces it")
    files = input_files(inputs)
    total = sum(p.stat().st_size for p in files)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / ".order-cache", ignore_errors=True)
    bar = _progress(total, progress)
    docs = skipped = tokens = text_bytes = 0
    dtype = token_dtype(tokenizer.vocab_size)
    with IndexedWriter(out / "data", dtype) as writer:
        pending: list[str] = []
        pending_bytes = 0

        def flush() -> None:
            nonlocal docs, skipped, tokens, text_bytes
            for text, ids in zip(pending, tokenizer.encode_batch(pending)):
                if not ids:
                    skipped += 1
                    continue
                text_bytes += len(text.encode("utf-8"))
                if tokenizer.eos_token is not None:
                    ids = [*ids, tokenizer.eos_token]
                writer.add(ids)
                docs += 1
                tokens += len(ids)
            pending.clear()

        for text in documents(files, text_field, bar.update):
            pending.append(text)
            pending_bytes += len(text)
            if pending_bytes >= BATCH_BYTES:
                flush()
                pending_bytes = 0
        flush()
    bar.close()
    if docs == 0:
        raise DatasetError(f"{out.name}: the inputs hold no non-empty document")
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
    fingerprint = file_digest([out / "data.bin", out / "data.idx"])
    manifest = Manifest(directory=out, name=name or out.name, format="megatron", vocab_size=tokenizer.vocab_size,
                        fingerprint=fingerprint, validation_fraction=validation_fraction,
                        eos_token=tokenizer.eos_token, tokenizer=tokenizer.describe(), prefix="data",
                        documents=docs, tokens=tokens, text_bytes=text_bytes)
    write_manifest(manifest)
    return PrepareResult(out, docs, skipped, tokens, total, time.perf_counter() - started, manifest)


class _Quiet:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, shown: bool):
    if not shown:
        return _Quiet()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, mininterval=0.5)
