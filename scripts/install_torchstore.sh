#!/usr/bin/env bash
# Install torchstore (meta-pytorch/torchstore, pinned commit) with torchmonarch into its own virtual
# environment, for the `torchstore` rows of `weight-transfer bench-peers` (docs/PEERS.md).
#
#   bash scripts/install_torchstore.sh                  # from git (needs network to the repository)
#   bash scripts/install_torchstore.sh /path/torchstore # from a source tree (a checkout or an export)
#   bash scripts/install_torchstore.sh /path/repo.git   # from a bare git directory (a mirror): the pinned commit
#   VENV=/opt/wt-torchstore TORCHMONARCH=0.7.0 TORCH=torch==2.13.0 bash scripts/install_torchstore.sh
#
# Why a separate environment: the only torchstore release (0.1.2) pins torch==2.9.0 and
# torchmonarch==0.1.2; its git HEAD runs on the project's torch 2.13.0 but pulls torchmonarch and
# its dependencies (pyarrow, flask, torchx, ...), which the project's own environment does not
# need. The bench runs the torchstore rows in $VENV/bin/python as a subprocess.
#
# torchmonarch: 0.7.0 by default (torchstore's source pins 0.4.1; the source is installed with
# --no-deps and its dependencies named here). Measured on a 2-core CPU VM: with 0.4.1 the shared-
# memory, gloo and RPC transports run, but monarch's RDMA TCP fallback (no ibverbs device) aborts
# the process ("[RdmaXcel] Can't open libcuda.so.1", SIGABRT); with 0.7.0 it runs, so the RDMA and
# DirectWeightSync rows run too. TORCHMONARCH=0.4.1 installs torchstore's own pin.
#
# Idempotent: when $VENV already imports torchstore, monarch and torch at the wanted versions and
# $VENV/torchstore.commit names the wanted commit, it prints that and does nothing. About 2.5 min
# on a 2-core VM when it installs (torch from an on-disk wheel; torchmonarch is a 93 MB wheel).
set -euo pipefail

SHA="${TORCHSTORE_SHA:-5a4d5d3f4d653f2ed7cc913a66e49f822dfd6c1d}"  # 2026-06-29, "separate cuda copy stream for tensor push (#172)"
SOURCE="${1:-git+https://github.com/meta-pytorch/torchstore@$SHA}"
VENV="${VENV:-/opt/wt-torchstore}"
TORCHMONARCH="${TORCHMONARCH:-0.7.0}"
TORCH="${TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"

want_torch="${TORCH#torch==}"
check() {  # exit 0 when the environment is complete
    [ -x "$PY" ] && [ "$(cat "$VENV/torchstore.commit" 2>/dev/null)" = "$SHA" ] && "$PY" - "$TORCHMONARCH" "$want_torch" <<'EOF' 2>/dev/null
import sys, importlib.metadata as m
import torchstore, monarch.actor, torch  # noqa: F401
assert m.version("torchmonarch") == sys.argv[1], m.version("torchmonarch")
assert sys.argv[2] == "torch" or torch.__version__.split("+")[0] == sys.argv[2].split("+")[0], torch.__version__
EOF
}

if check; then
    echo "torchstore ${SHA:0:7} already installed in $VENV (torchmonarch $TORCHMONARCH); nothing to do"
    exit 0
fi

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch, sys; v=sys.argv[1]; sys.exit(0 if v == 'torch' or torch.__version__.split('+')[0] == v.split('+')[0] else 1)" "$want_torch" 2>/dev/null; then
    echo "installing $TORCH into $VENV"
    "$PY" -m pip install -q "$TORCH"
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
case "$SOURCE" in
    git+*|http://*|https://*)
        src="torchstore @ ${SOURCE#torchstore @ }"
        case "$SOURCE" in git+*) ;; *) src="torchstore @ git+$SOURCE@$SHA" ;; esac ;;
    *)
        if [ -d "$SOURCE" ] && [ -f "$SOURCE/HEAD" ] && [ -d "$SOURCE/objects" ]; then  # a bare git directory
            git --git-dir="$SOURCE" cat-file -e "$SHA^{commit}" 2>/dev/null || {
                echo "error: $SOURCE has no commit $SHA (TORCHSTORE_SHA overrides the pin)" >&2; exit 1; }
            git --git-dir="$SOURCE" archive "$SHA" | tar -x -C "$tmp"
            src="$tmp"
        elif [ -f "$SOURCE/pyproject.toml" ] && [ -d "$SOURCE/torchstore" ]; then
            if have="$(git -C "$SOURCE" rev-parse HEAD 2>/dev/null)" && [ "$have" != "$SHA" ]; then
                echo "note: $SOURCE is at $have, not the pinned $SHA; recording $have" >&2
                SHA="$have"
            fi
            src="$SOURCE"
        else
            echo "error: $SOURCE is neither a git URL, a bare git directory nor a torchstore source tree" >&2
            exit 1
        fi ;;
esac

echo "installing torchstore ${SHA:0:7} from $SOURCE and torchmonarch==$TORCHMONARCH into $VENV"
# torchstore's own dependencies (its pyproject: pygtrie, portpicker, torch, torchmonarch==0.4.1), the
# monarch pin replaced by $TORCHMONARCH; torch stays the one installed above.
"$PY" -m pip install -q "torchmonarch==$TORCHMONARCH" pygtrie portpicker
# pip then reports "torchstore ... requires torchmonarch==0.4.1, but you have torchmonarch 0.7.0": expected
"$PY" -m pip install -q --no-deps --force-reinstall "$src"
echo "$SHA" > "$VENV/torchstore.commit"

if ! check; then
    echo "error: $VENV does not import torchstore/monarch/torch as wanted after the install" >&2
    "$PY" -c "import torchstore, monarch.actor, torch" || true
    exit 1
fi
"$PY" -c "import importlib.metadata as m; print('ok:', ', '.join(f'{d} {m.version(d)}' for d in ('torchstore', 'torchmonarch', 'torch')))"
if [ "$VENV" = /opt/wt-torchstore ]; then
    echo "torchstore ${SHA:0:7} installed in $VENV; weight-transfer bench-peers finds $PY"
else
    echo "torchstore ${SHA:0:7} installed in $VENV; run bench-peers with WT_TORCHSTORE_PYTHON=$PY (or --torchstore-python)"
fi
