"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""
from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes, fsync: bool = True) -> Path:
    """Write to a hidden temp file beside `path` (`.<name>.tmp-<pid>`), then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_text(path: str | Path, text: str, fsync: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def write_json_atomic(path: str | Path, data, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=indent, ensure_ascii=False, default=str) + "\n")
