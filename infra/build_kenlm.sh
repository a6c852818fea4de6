#!/usr/bin/env bash
# Build KenLM's `lmplz` and `build_binary` from the kenlm source distribution on PyPI (the pip
# module only queries models). Output: infra/.build/kenlm/bin/{lmplz,build_binary}. Idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/infra/.build/kenlm"
BIN="$OUT/bin"
KENLM_VERSION="0.3.0"  # same as the pinned python module

if [ -x "$BIN/lmplz" ] && [ -x "$BIN/build_binary" ]; then
    echo "setup: kenlm lmplz/build_binary present ($BIN)"
    exit 0
fi
PY="$ROOT/.venv/bin/python"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
LOG="$OUT/build.log"
mkdir -p "$OUT" "$BIN"
: > "$LOG"
echo "setup: building kenlm $KENLM_VERSION lmplz/build_binary (≈1 min; log: $LOG)"
"$PY" -m pip download --disable-pip-version-check --no-deps --no-binary kenlm "kenlm==$KENLM_VERSION" -d "$WORK" >>"$LOG" 2>&1
tar -xzf "$WORK"/kenlm-*.tar.gz -C "$WORK"
SRC="$(find "$WORK" -maxdepth 1 -type d -name 'kenlm-*' | head -n 1)"
mkdir -p "$SRC/build"
(
    cd "$SRC/build"
    cmake .. -DCMAKE_BUILD_TYPE=Release >>"$LOG" 2>&1
    make -j"$(nproc)" lmplz build_binary >>"$LOG" 2>&1
) || { tail -n 30 "$LOG" >&2; echo "setup: kenlm build failed (log: $LOG)" >&2; exit 1; }
cp "$SRC/build/bin/lmplz" "$SRC/build/bin/build_binary" "$BIN/"
echo "setup: kenlm binaries in $BIN"
