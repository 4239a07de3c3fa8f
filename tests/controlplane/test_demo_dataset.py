"""The demo's dataset (issue 42): `dynaplane up`'s bootstrap prepares the Python standard library's
.py files (here a small stand-in source folder, the same code path) once into
<data root>/python-stdlib, registers it, and the demo job trains tiny-gpt on it; a later bootstrap
reuses it untouched; a preparation that fails leaves the demo on synthetic tokens, saying why."""
from __future__ import annotations

import io
import json
import sysconfig
from pathlib import Path

import pytest
from django.core.management import call_command

from parallelism.datasets.describe import describe
from controlplane.datasets.demo import DEMO_DATASET, stdlib_sources
from controlplane.datasets.models import Dataset
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db


@pytest.fixture
def source(tmp_path, settings) -> Path:
    settings.VAR_DIR = tmp_path
    settings.DYNAPLANE_DATA_ROOT = str(tmp_path / "data")
    folder = tmp_path / "lib"
    (folder / "json").mkdir(parents=True)
    (folder / "site-packages" / "thirdparty").mkdir(parents=True)
    (folder / "os.py").write_text("import sys\n\ndef getcwd():\n    return '.'\n" * 40)
    (folder / "json" / "__init__.py").write_text("def dumps(obj):\n    return repr(obj)\n" * 40)
    (folder / "json" / "notes.txt").write_text("not python")
    (folder / "site-packages" / "thirdparty" / "x.py").write_text("installed, not the standard library\n")
    return folder


def bootstrap(source: Path) -> dict:
    out = io.StringIO()
    call_command("dynaplane_bootstrap", "--demo", "--demo-source", str(source), stdout=out)
    return json.loads(out.getvalue())


def test_the_demo_trains_on_the_prepared_source_and_a_second_start_reuses_it(source, tmp_path) -> None:
    first = bootstrap(source)
    dataset = Dataset.objects.get(name=DEMO_DATASET)
    assert first["dataset"]["id"] == dataset.pk and first["dataset"]["prepared_seconds"] >= 0
    assert (dataset.path, dataset.format, dataset.vocab_size, dataset.tokenizer, dataset.validation_fraction,
            dataset.documents) == ("python-stdlib", "megatron", 257, "bytes", 0.01, 2)  # os.py, json/__init__.py
    manifest = tmp_path / "data" / "python-stdlib" / "dataset.json"
    demo = Job.objects.get(name="demo")
    assert demo.dataset_id == dataset.pk and demo.model == "tiny-gpt"  # 512 rows >= 257 byte tokens
    # this small source's held-out split cannot fill the demo's evaluation: it trains without one
    # (on the standard library it evaluates every 25 steps: test_stack's demo test)
    assert demo.eval_every == 0
    assert demo.dataset_samples_per_epoch == describe(manifest.parent, demo.seq_len)["samples_per_epoch"] > 0
    written = manifest.stat().st_mtime_ns
    second = bootstrap(source)
    assert second["dataset"] == {**first["dataset"], "prepared_seconds": None}
    assert manifest.stat().st_mtime_ns == written and Dataset.objects.count() == 1 and Job.objects.count() == 1


def test_a_demo_whose_data_is_gone_prepares_it_again(source, tmp_path) -> None:
    first = bootstrap(source)
    (tmp_path / "data" / "python-stdlib" / "dataset.json").unlink()
    second = bootstrap(source)
    assert second["dataset"]["id"] == first["dataset"]["id"] and second["dataset"]["prepared_seconds"] is not None
    assert Dataset.objects.get().fingerprint == describe(tmp_path / "data" / "python-stdlib", 1)["fingerprint"]


def test_a_preparation_that_fails_leaves_the_demo_on_synthetic_tokens(source, tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = bootstrap(empty)
    assert "no non-empty document" in out["dataset"]["error"]
    assert Job.objects.get(name="demo").dataset is None and not Dataset.objects.exists()


def test_the_standard_library_sources_are_its_py_files_without_installed_packages(source) -> None:
    assert [p.relative_to(source).as_posix() for p in stdlib_sources(source)] == ["json/__init__.py", "os.py"]
    files = stdlib_sources()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 500 and root / "os.py" in files and files == sorted(files)
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


def test_a_registered_demo_dataset_whose_data_changed_leaves_a_new_demo_on_synthetic_tokens(source, tmp_path) -> None:
    from tests.support.datasets import text_dataset

    bootstrap(source)
    Job.objects.all().delete()
    text_dataset(tmp_path / "data" / "python-stdlib", texts=["other data\n" * 50] * 3, name=DEMO_DATASET)
    out = bootstrap(source)
    assert "holds other data than when it was registered" in out["dataset"]["error"]
    assert Job.objects.get(name="demo").dataset is None
