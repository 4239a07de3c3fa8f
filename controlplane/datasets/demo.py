"""The demo's dataset: the Python standard library's own source (every machine has it), its .py
files tokenized as bytes (vocab 257: tiny-gpt's 512 rows hold them), prepared once into
<data root>/python-stdlib and reused whenever its dataset.json is there (`make run` stays ready
in seconds on a machine that prepared it once), and registered once."""
from __future__ import annotations

import sysconfig
import time
from pathlib import Path

from django.conf import settings

from controlplane.datasets.models import Dataset
from controlplane.datasets.services import dataset_register

DEMO_DATASET = "python-stdlib"
VALIDATION_FRACTION = 0.01
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages are not the stdlib


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The .py files of the standard library (or of `root`), sorted: the document order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not SKIPPED_FOLDERS.intersection(p.relative_to(root).parts[:-1]) and p.is_file())


def demo_dataset_ensure(*, source: str | Path | None = None, created_by=None) -> tuple[Dataset, float | None]:
    """The demo dataset, prepared from `source` (default: the standard library) when its
    directory holds no dataset.json yet, and registered when it is not. Returns it and how long
    the preparation took (None: it was prepared before). DatasetError or OSError when it cannot
    be prepared (e.g. a read-only data root); InvalidInput when it cannot be registered."""
    from parallelism.datasets.prepare import prepare

    directory = Path(settings.DYNAPLANE_DATA_ROOT) / DEMO_DATASET
    seconds = None
    if not (directory / "dataset.json").is_file():
        started = time.perf_counter()
        prepare(stdlib_sources(source), directory, validation_fraction=VALIDATION_FRACTION, name=DEMO_DATASET,
                force=True, progress=False)
        seconds = time.perf_counter() - started
    dataset = Dataset.objects.filter(name=DEMO_DATASET).first()
    if dataset is None:
        dataset = dataset_register(path=DEMO_DATASET, name=DEMO_DATASET, created_by=created_by)
    return dataset, seconds
