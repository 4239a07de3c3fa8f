"""Tokenizers for `dynaplane data prepare`: a Hugging Face `tokenizer.json` through the `tokenizers`
package (its Rust batch encoder), or, when none is given, bytes (ids 0-255, end of document 256)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from parallelism.datasets.errors import DatasetError

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens; 256 ends a document."""

    vocab_size = 257
    eos_token = 256
    fingerprint = "bytes-v1"

    def describe(self) -> dict:
        return {"kind": "bytes", "fingerprint": self.fingerprint}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class HFTokenizer:
    """A `tokenizer.json` (what `transformers` saves beside a model)."""

    def __init__(self, path: str | Path, eos: str | None = None) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
            self.tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except FileNotFoundError:
            raise DatasetError(f"{self.path.name}: missing") from None
        except Exception as exc:  # tokenizers raises its own Exception type on a malformed file
            raise DatasetError(f"{self.path.name}: not a Hugging Face tokenizer.json ({exc})") from None
        self.fingerprint = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        names = [eos] if eos else list(EOS_CANDIDATES)
        ids = [self.tokenizer.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if eos and not found:
            raise DatasetError(f"{self.path.name}: has no token {eos!r} to end documents with")
        self.eos_name, self.eos_token = found[0] if found else (None, None)

    def describe(self) -> dict:
        return {"kind": "hf", "file": "tokenizer.json", "fingerprint": self.fingerprint, "eos": self.eos_name}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
