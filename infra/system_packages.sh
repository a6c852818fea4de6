#!/usr/bin/env bash
# Debian packages Crucible needs beyond Python. Installs only what is missing; needs root (or sudo)
# and apt-get.
#
#   bash infra/system_packages.sh           # the C++ toolchain and libraries of the KenLM build, and
#                                           #   PostgreSQL (stack.database=postgres)
#   bash infra/system_packages.sh --tests   # + headless Chromium and its driver (the browser tests)
#
# Chromium is the largest download of the set-up and only the browser tests drive it, so the demo's
# set-up leaves it out. No Eigen: it only enables KenLM's interpolation program, which is not built.
set -euo pipefail

PACKAGES=(
    cmake g++ make zlib1g-dev libbz2-dev liblzma-dev
    libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev
    postgresql
)
case "${1:-}" in
    "") ;;
    --tests) PACKAGES+=(chromium chromium-driver) ;;
    *) echo "usage: $0 [--tests]" >&2; exit 2 ;;
esac

# one dpkg-query for all (a process per package cost seconds on a loaded machine)
installed="$(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null | awk '/install ok installed$/ { print $1 }' || true)"
missing=()
for p in "${PACKAGES[@]}"; do
    grep -qx "$p" <<<"$installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && { echo "setup: Debian packages present"; exit 0; }

if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: missing system packages (${missing[*]}) and no apt-get; install them with your package manager" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup: installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
LOG="$(mktemp)"
if ! { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "setup: apt-get install failed (full log: $LOG)" >&2
    exit 1
fi
rm -f "$LOG"
