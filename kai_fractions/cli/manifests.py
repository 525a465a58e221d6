"""Reading YAML manifests for the CLI: files, directories, or `-` for stdin."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ..contract import ManifestError, PodView, pod_views


class InputError(Exception):
    """Unreadable input: the message names the file and what is wrong (exit code 2)."""


def _files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.suffix in (".yaml", ".yml") and f.is_file())
    if not p.exists():
        raise InputError(f"{path}: no such file or directory")
    return [p]


def load_documents(paths: list[str]) -> Iterator[tuple[str, Any]]:
    """(source, document) for every non-empty YAML document; raises InputError."""
    for path in paths:
        if path == "-":
            sources = [("<stdin>", sys.stdin.read())]
        else:
            sources = []
            for f in _files(path):
                try:
                    sources.append((str(f), f.read_text()))
                except (OSError, UnicodeDecodeError) as e:
                    raise InputError(f"{f}: cannot read: {e}") from None
        for name, text in sources:
            try:
                docs = list(yaml.safe_load_all(text))
            except yaml.YAMLError as e:
                raise InputError(f"{name}: not valid YAML: {e}".splitlines()[0]) from None
            for doc in docs:
                if doc is None:
                    continue
                if not isinstance(doc, dict):
                    raise InputError(f"{name}: a document is not a Kubernetes object (a mapping)")
                yield name, doc


def load_pod_views(paths: list[str]) -> list[PodView]:
    """Every pod and pod template in the files; raises InputError for a malformed object."""
    views: list[PodView] = []
    for name, doc in load_documents(paths):
        try:
            views.extend(pod_views(doc))
        except ManifestError as e:
            raise InputError(f"{name}: {doc.get('kind') or 'object'}: {e}") from None
    return views
