"""`dynaplane data prepare`: text, JSONL and Parquet in; the tokens are the tokenizer's, documents kept apart."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dynaplane.cli import main
from parallelism.datasets.describe import describe
from parallelism.datasets.errors import DatasetError
from parallelism.datasets.indexed import IndexedDataset
from parallelism.datasets.prepare import prepare
from parallelism.datasets.tokenizer import HFTokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "", "Größe — naïve café\n", "print('hello world')\n" * 5]


def _docs(out):
    data = IndexedDataset(out / "data")
    return [data.sequence(i).tolist() for i in range(len(data))]


def test_text_files_byte_level(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for n, text in enumerate(TEXTS):
        (src / f"{n}.py").write_text(text, encoding="utf-8")
    (src / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix
    result = prepare([src], tmp_path / "out", progress=False, validation_fraction=0.25)
    expected = [list(t.encode()) + [256] for t in TEXTS if t]
    assert _docs(tmp_path / "out") == expected
    assert (result.documents, result.skipped, result.tokens) == (3, 1, sum(map(len, expected)))
    text_bytes = sum(len(t.encode()) for t in TEXTS if t)
    assert result.manifest.text_bytes == text_bytes  # bits per byte = bits per token / bytes per token
    assert result.manifest.bytes_per_token == text_bytes / result.tokens
    info = describe(tmp_path / "out", 8)
    assert info["vocab_size"] == 257 and info["documents"] == 3 and info["validation_documents"] == 1


def test_jsonl_and_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "id": n}) for n, t in enumerate(TEXTS)))
    pq.write_table(pa.table({"body": TEXTS[::-1]}), tmp_path / "b.parquet")
    prepare([tmp_path / "a.jsonl"], tmp_path / "j", progress=False)
    prepare([tmp_path / "b.parquet"], tmp_path / "p", progress=False, text_field="body")
    assert _docs(tmp_path / "j") == [list(t.encode()) + [256] for t in TEXTS if t]
    assert _docs(tmp_path / "p") == [list(t.encode()) + [256] for t in TEXTS[::-1] if t]
    with pytest.raises(DatasetError, match="b.parquet: has no column 'text' \\(columns: body\\)"):
        prepare([tmp_path / "b.parquet"], tmp_path / "q", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(DatasetError, match="bad.jsonl: line 2 has no string field 'text'"):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "r", progress=False)


def _tokenizer_json(tmp_path):
    """A small BPE tokenizer trained here on the test's own text (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json", tok


def test_hugging_face_tokenizer(tmp_path):
    path, tok = _tokenizer_json(tmp_path)
    (tmp_path / "in.txt").write_text(TEXTS[0])
    result = prepare([tmp_path / "in.txt"], tmp_path / "out", HFTokenizer(path), progress=False)
    eos = tok.token_to_id("<|endoftext|>")
    assert _docs(tmp_path / "out") == [tok.encode(TEXTS[0], add_special_tokens=False).ids + [eos]]
    m = result.manifest
    assert m.vocab_size == tok.get_vocab_size() and m.eos_token == eos and m.tokenizer["kind"] == "hf"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == path.read_bytes()
    with pytest.raises(DatasetError, match="tokenizer.json: has no token '<eot>'"):
        HFTokenizer(path, "<eot>")


def test_cli_prepare_and_its_errors(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("hello\n")
    assert main(["data", "prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d"), "--quiet", "--json",
                 "--validation-fraction", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 1 and summary["tokens"] == 7 and summary["mb_per_second"] >= 0
    assert main(["data", "prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d"), "--quiet"]) == 2
    assert "d: already holds a dataset (dataset.json); --force replaces it" in capsys.readouterr().err
    assert main(["data", "prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "e"), "--quiet"]) == 2
    assert "nope: no such file or directory" in capsys.readouterr().err
    assert main(["data", "describe", str(tmp_path / "d"), "--seq", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples_per_epoch"] == 1
    (tmp_path / "d" / "data.bin").write_bytes(b"\x00")
    assert main(["data", "describe", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "data.bin: 1 bytes, its index data.idx describes 14" in err and str(tmp_path) not in err
