#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs, for a GPU machine without network access.
#
#   scripts/gpu_wheels.sh [--dest DIR] [--python-version 3.12] [--cuda 13|12] [--no-slim]
#                         [--with-triton] [--with-torch] [--dry-run] [-h|--help]
#
# Run it where pip reaches the registries; carry DIR (default .whl/, git-ignored) to the GPU
# machine; gpu_check.sh installs every wheel in it with `pip install --no-index --no-deps
# --target`. Wheels are for Linux x86_64, CPython --python-version (the H200 image's python3 is
# 3.12, with torch 2.11.0+cu130, triton 3.6.0, numpy, pandas, pytest, rich already installed).
#
# Default set (what that image lacks): nixl-cu13==1.5.1 (--cuda 13, matches a cu13x torch) or
# nixl-cu12==1.5.1 (--cuda 12), pyzmq, submitit. The NIXL wheel is slimmed (scripts/slim_wheel.py:
# its unused nixl_ep expert-parallel package and C++ headers go, 56 -> 28 MiB for nixl-cu13) so
# that the wheels and the working tree (about 11 MiB) fit in the 64 MiB one device call carries;
# the total is printed at the end. --no-slim keeps the wheel as published.
# --with-triton  also triton==3.8.0 (248 MB: for machines that lack triton; too big to carry)
# --with-torch   also torch==2.13.0 for CUDA --cuda with its CUDA libraries (several GB, from
#                TORCH_INDEX, default https://download.pytorch.org/whl/cu130 or .../cu128)
# --dry-run      print the pip commands, download nothing
#
# DIR's old wheels are replaced (gpu_check.sh needs one version of each). Exit status: 0 done,
# 1 a download failed, 2 bad arguments.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
PYV=3.12
CUDA=13
TRITON=0
TORCH=0
DRY=0
SLIM=1
PIP="${PIP:-python3 -m pip}"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; echo "see: scripts/gpu_wheels.sh --help" >&2; exit 2; }
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dest) need_arg "$@"; DEST="$2"; shift ;;
    --python-version) need_arg "$@"; PYV="$2"; shift ;;
    --cuda) need_arg "$@"; CUDA="$2"; shift ;;
    --with-triton) TRITON=1 ;;
    --with-torch) TORCH=1 ;;
    --no-slim) SLIM=0 ;;
    --dry-run) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done
case "$CUDA" in 12|13) ;; *) die "--cuda is 12 or 13, got '$CUDA'" ;; esac
[[ "$PYV" =~ ^3\.[0-9]+$ ]] || die "--python-version looks like 3.12, got '$PYV'"

# manylinux tags pip must match exactly (the device README's list, plus newer glibc levels)
PLAT=()
for t in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux1; do
  PLAT+=(--platform "${t}_x86_64")
done
TARGET=(--only-binary=:all: --python-version "$PYV" --implementation cp "${PLAT[@]}")

PKGS=("nixl-cu${CUDA}==1.5.1" pyzmq submitit)
[ "$TRITON" = 1 ] && PKGS+=("triton==3.8.0")

run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# --no-deps: the image has every dependency of these but these; pip would otherwise try to
# resolve torch and numpy for the target platform too
run $PIP download -q --no-deps "${TARGET[@]}" -d "$TMP" "${PKGS[@]}"
if [ "$TORCH" = 1 ]; then
  idx="${TORCH_INDEX:-https://download.pytorch.org/whl/cu$([ "$CUDA" = 13 ] && echo 130 || echo 128)}"
  # with dependencies: the nvidia-* CUDA libraries and the triton this torch pins
  run $PIP download -q "${TARGET[@]}" --index-url "$idx" --extra-index-url https://pypi.org/simple \
    -d "$TMP" "torch==2.13.0"
fi
if [ "$SLIM" = 1 ]; then
  run python3 "$ROOT/scripts/slim_wheel.py" "$TMP"/nixl_cu*.whl
fi
[ "$DRY" = 1 ] && exit 0

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
mv "$TMP"/*.whl "$DEST"/
echo "wheels in $DEST:"
ls -l "$DEST"/*.whl | awk '{printf "  %8.1f MB  %s\n", $5 / 1e6, $NF}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$(cd "$ROOT" && git ls-files -z 2>/dev/null | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN{printf "%.1f", b / 1048576}'; }
echo "total $(mib "$total") MiB of wheels; with the tracked working tree ($(mib "$tree") MiB): $(mib $((total + tree))) MiB"
if [ $((total + tree)) -gt $((64 << 20)) ]; then
  echo "note: over 64 MiB: one device call carries at most 64 MiB (working tree and carried paths together)" >&2
fi
