"""What a dataset directory holds, checked (index against data, split, sample counts): what the
CLI's `data describe` prints and what the control plane stores when a dataset is registered.
Bounded work: the index is read and checked, the tokens are not scanned."""
from __future__ import annotations

import os

from parallelism.datasets.dataset import TokenDataset
from parallelism.datasets.errors import DatasetError


def describe(directory: str | os.PathLike, seq_len: int = 2048) -> dict:
    train = TokenDataset(directory, seq_len, split="train", cache=False)
    m = train.manifest
    parts = train.parts
    train_tokens = sum(int(p.doc_lengths[p.ids].sum()) for p in parts)
    total_tokens = sum(int(p.doc_lengths.sum()) for p in parts)
    documents = sum(len(p.doc_lengths) for p in parts)
    validation_documents = documents - sum(len(p.ids) for p in parts)
    info = {
        "name": m.name, "format": m.format, "vocab_size": m.vocab_size, "eos_token": m.eos_token,
        "tokenizer": m.tokenizer.get("kind", "unknown"), "tokenizer_fingerprint": m.tokenizer.get("fingerprint", ""),
        "fingerprint": m.fingerprint, "documents": documents, "tokens": total_tokens,
        "train_tokens": train_tokens, "validation_tokens": total_tokens - train_tokens,
        "validation_fraction": m.validation_fraction, "validation_documents": validation_documents,
        "seq": seq_len, "samples_per_epoch": train.samples_per_epoch,
        "bytes_per_token": m.bytes_per_token,
    }
    if m.format == "blend":
        info["parts"] = [{"name": p.manifest.name, "weight": b.weight, "tokens": int(p.doc_lengths.sum())}
                         for p, b in zip(parts, m.parts)]
    if m.format != "blend" and m.tokens and m.tokens != total_tokens:
        raise DatasetError(f"{m.directory.name}/dataset.json: says {m.tokens} tokens, its data holds {total_tokens}")
    return info
