"""What the benchmark scripts share. They run as `python benchmarks/<script>.py`, so this
directory is on sys.path and they import it as `from _common import ...`."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT


def data_root() -> Path:
    """The shared third-party data (CRUCIBLE_DATA_ROOT, else ../shared/data beside the repo)."""
    return Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)


def write_result(path: str | Path, result: dict, **json_options) -> None:
    """Write a benchmark's result as JSON (indent 2 unless told otherwise), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, **{"indent": 2, **json_options}) + "\n")


def add_int_options(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """One `--name N` option per keyword (underscores become dashes), defaulting to the keyword's value."""
    for name, default in defaults.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
