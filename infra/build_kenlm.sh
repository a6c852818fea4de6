#!/usr/bin/env bash
# KenLM, compiled once: one CMake build of the kenlm source distribution (the version pyproject.toml
# pins) gives both `lmplz`/`build_binary` (training the quality filter's model, tasks/quality/kenlm_lm.py)
# and the Python module that queries it, packed as a wheel for setup.sh to install.
# pip's own build of the sdist compiles every source twice (its setup.py runs a CMake build of a shared
# library that the module never loads, then compiles all files again as the extension), and the
# binaries then needed a third build.
#
#   bash infra/build_kenlm.sh [PYTHON]   # the interpreter the module is built for; default .venv's
#
# Output (git-ignored): infra/.build/kenlm/bin/{lmplz,build_binary} and
# infra/.build/kenlm/dist/kenlm-<version>-cp311-cp311-<platform>.whl. Idempotent: nothing to do when
# both are there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
OUT="$ROOT/infra/.build/kenlm"
BIN="$OUT/bin"
DIST="$OUT/dist"
KENLM_VERSION="0.3.0"  # = the kenlm pin in pyproject.toml
# sha256 of kenlm-0.3.0.tar.gz as the package index serves it: the source we compile is the one pinned
KENLM_SHA256="c4628bb9fb63c8a6f9240035b8b037385cfc404cb72e933cf48878291edac1e8"

if [ -x "$BIN/lmplz" ] && [ -x "$BIN/build_binary" ] && compgen -G "$DIST/kenlm-$KENLM_VERSION-*.whl" >/dev/null; then
    echo "setup: kenlm binaries and wheel present ($OUT)"
    exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
LOG="$OUT/build.log"
mkdir -p "$BIN" "$DIST"
: > "$LOG"
fail() { tail -n 30 "$LOG" >&2; echo "setup: kenlm build failed: $1 (log: $LOG)" >&2; exit 1; }

echo "setup: building kenlm $KENLM_VERSION once: lmplz, build_binary and the Python module (log: $LOG)"
# --no-build-isolation: pip reads the sdist's metadata with the venv's setuptools and wheel (setup.sh
# installs them from the lock first) instead of installing the sdist's build requirements (cmake's
# wheel among them) into a throw-away environment: 4 s instead of 17 s
"$PY" -m pip download --disable-pip-version-check --no-deps --no-build-isolation \
    "kenlm==$KENLM_VERSION" -d "$WORK" >>"$LOG" 2>&1 || fail "download"
echo "$KENLM_SHA256  $WORK/kenlm-$KENLM_VERSION.tar.gz" | sha256sum -c --quiet - >>"$LOG" 2>&1 \
    || fail "kenlm-$KENLM_VERSION.tar.gz does not have the pinned sha256"
tar -xzf "$WORK/kenlm-$KENLM_VERSION.tar.gz" -C "$WORK"
SRC="$WORK/kenlm-$KENLM_VERSION"
INCLUDE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
(
    mkdir -p "$SRC/build" && cd "$SRC/build"
    # ENABLE_PYTHON adds the module target, linked against the same static libraries as lmplz (hence
    # position-independent code). CMake's PythonLibs insists on a library path; an extension module
    # on Linux links against no libpython, so any path satisfies it.
    cmake .. -DCMAKE_BUILD_TYPE=Release -DENABLE_PYTHON=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
        -DPYTHON_EXECUTABLE="$PY" -DPYTHON_INCLUDE_DIR="$INCLUDE" -DPYTHON_LIBRARY="$INCLUDE/../libpython-unused.so"
    make -j"$(nproc)" lmplz build_binary kenlm_python
) >>"$LOG" 2>&1 || fail "cmake/make"
cp "$SRC/build/bin/lmplz" "$SRC/build/bin/build_binary" "$BIN/"

# The module as a wheel, so that the installer records kenlm==$KENLM_VERSION like any other package
"$PY" - "$SRC" "$DIST" "$KENLM_VERSION" <<'PYEOF' >>"$LOG" 2>&1 || fail "packing the wheel"
import base64, hashlib, sys, sysconfig, zipfile
from pathlib import Path

src, dist, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
info = f"kenlm-{version}.dist-info"
files = {
    "kenlm" + sysconfig.get_config_var("EXT_SUFFIX"): (src / "build/lib/kenlm.so").read_bytes(),
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: kenlm\nVersion: {version}\nLicense: LGPL-2.1-or-later\n".encode(),
    f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: crucible infra/build_kenlm.sh\nRoot-Is-Purelib: false\nTag: {tag}-{tag}-{plat}\n".encode(),
    f"{info}/top_level.txt": b"kenlm\n",
}
for lic in ("LICENSE", "COPYING", "COPYING.3", "COPYING.LESSER.3"):
    files[f"{info}/licenses/{lic}"] = (src / lic).read_bytes()
record = []
for name, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(data)}")
record.append(f"{info}/RECORD,,")
files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
whl = dist / f"kenlm-{version}-{tag}-{tag}-{plat}.whl"
with zipfile.ZipFile(whl.with_suffix(".tmp"), "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in files.items():
        entry = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        entry.external_attr = 0o644 << 16  # rw-r--r-- once installed (ZipFile's default is 0600)
        z.writestr(entry, data, zipfile.ZIP_DEFLATED)
whl.with_suffix(".tmp").rename(whl)
print(whl)
PYEOF
echo "setup: kenlm binaries in $BIN, module wheel in $DIST"
