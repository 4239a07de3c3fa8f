"""Where datasets lie: every dataset directory, and every file it reads, resolved (symlinks
followed) inside the data root (settings.DYNAPLANE_DATA_ROOT); and the dataset library's
refusals told with paths relative to that root, never an absolute path of the server."""
from __future__ import annotations

import os

from django.conf import settings

from parallelism.datasets.errors import DatasetError

from controlplane.common.errors import InvalidInput
from controlplane.datasets.models import MAX_PATH

# What a describe() of a directory may raise besides DatasetError (a ValueError): a file it
# cannot read, or numpy refusing a memmap of it.
READ_ERRORS = (ValueError, OSError, OverflowError, TypeError, KeyError, IndexError)


def read_problem(exc: Exception, directory: str) -> str:
    """What the dataset library said (DatasetError), told from the data root; another error by its type."""
    text = str(exc) if isinstance(exc, DatasetError) else f"could not be read ({type(exc).__name__})"
    return relative_message(text, directory)


def data_root() -> str:
    return os.path.realpath(settings.DYNAPLANE_DATA_ROOT)


def inside(root: str, path: str) -> bool:
    return path != root and os.path.commonpath([root, path]) == root


def shown(value: str) -> str:
    """An input path as a message may repeat it: a relative one as given (bounded), never an
    absolute one (it may name a place on the server)."""
    return "the absolute path given" if os.path.isabs(value) else repr(value[:200])


def dataset_folder(value: str, field: str = "path") -> tuple[str, str]:
    """(absolute real path, path relative to the data root) of the directory an API input
    names: relative paths are taken from the root, absolute ones must lie inside it; nothing
    (`..`, a symlink) may lead out of it."""
    if "\x00" in value:
        raise InvalidInput({field: ["must not contain NUL characters"]})
    text = value.strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput({field: ["must be UTF-8 text (it holds a lone surrogate)"]}) from None
    if not text:
        raise InvalidInput({field: ["give the dataset directory, relative to the data root (e.g. python-stdlib)"]})
    root = data_root()
    path = os.path.realpath(os.path.join(root, text))
    if not inside(root, path):
        raise InvalidInput({field: [f"{shown(text)} is outside the data root (DYNAPLANE_DATA_ROOT); give a directory "
                                    f"under it, relative to the root (symlinks may not lead out of it)"]})
    relative = os.path.relpath(path, root)
    if len(relative) > MAX_PATH:
        raise InvalidInput({field: [f"the directory's path under the data root is longer than {MAX_PATH} characters"]})
    if not os.path.isdir(path):
        raise InvalidInput({field: [f"{relative}: no such directory under the data root (`dynaplane data prepare "
                                    f"--out <data root>/{os.path.basename(relative)}` writes one)"]})
    return path, relative


def relative_message(text: str, directory: str) -> str:
    """A dataset library message (it names files by their names, `<dir>/dataset.json` by the
    directory's own name) told from the data root: `<relative dir>: <file>: <rule>`, and any
    absolute path under the root made relative to it."""
    root, configured = data_root(), os.path.abspath(settings.DYNAPLANE_DATA_ROOT)
    real = os.path.realpath(directory)
    relative = os.path.relpath(real, root) if inside(root, real) else os.path.basename(directory)
    for prefix in sorted({root, configured}, key=len, reverse=True):
        text = text.replace(prefix + os.sep, "").replace(prefix, "<data root>")
    base = os.path.basename(directory)
    if text.startswith(base + "/"):
        return relative + text[len(base):]
    return f"{relative}: {text}"
