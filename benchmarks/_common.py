"""What the benchmark scripts share. They run as `python benchmarks/<script>.py`, so this
directory is on sys.path and they import it as `from _common import ...`."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT

REPO = Path(__file__).resolve().parent.parent


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


def code_commit(checkout: str | Path = REPO, *paths: str) -> str | None:
    """The short commit `checkout` has checked out, + "-dirty" where `paths` (default: all of it) hold
    uncommitted changes, so a figure names the code that produced it; None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--", *paths)
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None
