"""Folders an API input names under one of the control plane's roots on shared storage (the data
root of datasets, the weights root of Hugging Face models, ...): the input is taken relative to the
root, or absolute inside it, and nothing (`..`, a symlink) may lead out of it. Refusals are
InvalidInput naming the field and the rule; paths in messages are relative to the root, never an
absolute path of the server."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controlplane.common.errors import InvalidInput


def inside(root: str, path: str) -> bool:
    """Is `path` strictly inside `root` (both real, absolute paths)?"""
    return path != root and os.path.commonpath([root, path]) == root


def shown(value: str) -> str:
    """An input path as a message may repeat it: a relative one as given (bounded), never an
    absolute one (it may name a place on the server)."""
    return "the absolute path given" if os.path.isabs(value) else repr(value[:200])


@dataclass(frozen=True)
class Root:
    """One root folder: its configured path (a setting), what messages call it (`data root`), the
    setting's name, and the label an absolute path under it becomes in a message."""

    configured: str
    what: str
    setting: str

    @property
    def real(self) -> str:
        return os.path.realpath(self.configured)

    @property
    def label(self) -> str:
        return f"<{self.what}>"

    def strip(self, text: str) -> str:
        """`text` with every absolute path under the root told relative to it (the root itself
        as its label), for the real and the configured spelling of the root."""
        for prefix in sorted({self.real, os.path.abspath(self.configured)}, key=len, reverse=True):
            text = text.replace(prefix + os.sep, "").replace(prefix, self.label)
        return text


def folder_under(root: Root, value: str, *, field: str, empty: str, missing: Callable[[str], str],
                 max_length: int) -> tuple[str, str]:
    """(absolute real path, path relative to the root) of the directory an API input names:
    relative paths are taken from the root, absolute ones must lie inside it; nothing (`..`, a
    symlink) may lead out of it. `empty`: the message for an empty input; `missing(relative)`:
    the hint after "no such directory under the <root>"."""
    if "\x00" in value:
        raise InvalidInput({field: ["must not contain NUL characters"]})
    text = value.strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput({field: ["must be UTF-8 text (it holds a lone surrogate)"]}) from None
    if not text:
        raise InvalidInput({field: [empty]})
    real_root = root.real
    path = os.path.realpath(os.path.join(real_root, text))
    if not inside(real_root, path):
        raise InvalidInput({field: [f"{shown(text)} is outside the {root.what} ({root.setting}); give a directory "
                                    f"under it, relative to the root (symlinks may not lead out of it)"]})
    relative = os.path.relpath(path, real_root)
    if len(relative) > max_length:
        raise InvalidInput({field: [f"the directory's path under the {root.what} is longer than {max_length} "
                                    f"characters"]})
    if not os.path.isdir(path):
        raise InvalidInput({field: [f"{relative}: no such directory under the {root.what}{missing(relative)}"]})
    return path, relative


def escaping_entry(root: Root, directory: str, names: Iterable[str]) -> str | None:
    """The first of `names` (files of `directory`) that is a symlink leading out of the root; None
    when none does."""
    real_root = root.real
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path) and not inside(real_root, os.path.realpath(path)):
            return name
    return None
