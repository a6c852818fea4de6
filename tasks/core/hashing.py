"""Content hashes used as artifact versions (lineage) and in shard manifests."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: str | Path) -> str:
    """Hash of a file, or of a directory as the sorted (relative path, file hash) list."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    return tree_digest((str(p.relative_to(path)), sha256_file(p))
                       for p in sorted(q for q in path.rglob("*") if q.is_file()))


def tree_digest(entries: Iterable[tuple[str, str]]) -> str:
    """sha256_tree's digest of (relative path, file sha256) pairs given in path-part order: one
    definition for a local tree and a store's (tasks.core.fs.tree_sha256)."""
    h = hashlib.sha256()
    for rel, file_sha in entries:
        h.update(rel.encode())
        h.update(b"\0")
        h.update(file_sha.encode())
        h.update(b"\n")
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
