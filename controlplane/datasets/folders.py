"""Where datasets lie: every dataset directory, and every file it reads, resolved (symlinks
followed) inside the data root (settings.DYNAPLANE_DATA_ROOT); and the dataset library's
refusals told with paths relative to that root, never an absolute path of the server."""
from __future__ import annotations

import os

from django.conf import settings

from parallelism.datasets.errors import DatasetError

from controlplane.common.folders import Root, folder_under, inside
from controlplane.datasets.models import MAX_PATH

# What a describe() of a directory may raise besides DatasetError (a ValueError): a file it
# cannot read, or numpy refusing a memmap of it.
READ_ERRORS = (ValueError, OSError, OverflowError, TypeError, KeyError, IndexError)


def read_problem(exc: Exception, directory: str) -> str:
    """What the dataset library said (DatasetError), told from the data root; another error by its type."""
    text = str(exc) if isinstance(exc, DatasetError) else f"could not be read ({type(exc).__name__})"
    return relative_message(text, directory)


def data_root_folder() -> Root:
    return Root(settings.DYNAPLANE_DATA_ROOT, "data root", "DYNAPLANE_DATA_ROOT")


def data_root() -> str:
    return os.path.realpath(settings.DYNAPLANE_DATA_ROOT)


def dataset_folder(value: str, field: str = "path") -> tuple[str, str]:
    """(absolute real path, path relative to the data root) of the directory an API input
    names: relative paths are taken from the root, absolute ones must lie inside it; nothing
    (`..`, a symlink) may lead out of it."""
    return folder_under(
        data_root_folder(), value, field=field, max_length=MAX_PATH,
        empty="give the dataset directory, relative to the data root (e.g. python-stdlib)",
        missing=lambda relative: (f" (`dynaplane data prepare --out <data root>/{os.path.basename(relative)}` "
                                  f"writes one)"))


def relative_message(text: str, directory: str) -> str:
    """A dataset library message (it names files by their names, `<dir>/dataset.json` by the
    directory's own name) told from the data root: `<relative dir>: <file>: <rule>`, and any
    absolute path under the root made relative to it."""
    root = data_root()
    real = os.path.realpath(directory)
    relative = os.path.relpath(real, root) if inside(root, real) else os.path.basename(directory)
    text = data_root_folder().strip(text)
    base = os.path.basename(directory)
    if text.startswith(base + "/"):
        return relative + text[len(base):]
    return f"{relative}: {text}"
