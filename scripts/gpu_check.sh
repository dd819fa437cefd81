#!/usr/bin/env bash
# One GPU check in one go (issue 18; docs/GPU.md): under 10 minutes on one H200.
#
#   scripts/gpu_check.sh [--dry-run] [--steps a,b,...] [--results DIR] [--python PY]
#                        [--wheels DIR] [--site DIR] [--list] [-h|--help]
#   make gpu-check [GPU_CHECK_ARGS="--steps quant,nixl"]
#
# Steps (in this order; each under its own time limit, one failing does not stop the next):
#   env       device, driver, python, torch and its CUDA, written to RESULTS/device.txt
#   install   what is missing, from WHEELS (.whl/, made by scripts/gpu_wheels.sh) if it holds
#             wheels, else from the package registries: a CUDA build of torch, triton, NIXL
#             (nixl-cu13 for a CUDA 13 torch, else nixl-cu12), pyzmq, submitit, pytest-timeout
#   tests     the GPU-marked tests (pytest -m gpu, in the files that have some): CUDA IPC transport,
#             Triton FP8 kernel, executor's CUDA side stream, the trial with every process on the GPU;
#             a GPU test that is SKIPPED here fails the step (RESULTS/gpu_tests.csv, one row a test)
#   quant     FP8 block quantization on the GPU: Triton and torch quantizers beside the same-run
#             device-to-device copy (weight-transfer bench-quant --device cuda); fails when
#             the Triton kernel cannot run
#   cuda_ipc  the main job, training and inference processes sharing the GPU through cuda_ipc
#             (one-sided), every update verified on the host
#             (weight-transfer run --device cuda --transport cuda_ipc)
#   nixl      NIXL over UCX's CUDA transports, VRAM -> VRAM between two processes, verified
#             (scripts/gpu_nixl_check.py)
#   worker_cuda  the one_sided vLLM worker engine's own register-and-publish path
#             (WorkerTargets.receive) over a CUDA nn.Module: transport chosen from the tensors
#             (cuda_ipc), one region of one part per allocation, written by another process and
#             verified byte for byte; the init refusals (cma forced, a meta tensor)
#             (scripts/gpu_worker_receive.py --device cuda; needs no vLLM)
#   vllm_backends  this project's one_sided vLLM weight-transfer backend beside vLLM's own nccl
#             and ipc backends: the same tiny model, GPU and vLLM calls, every update verified
#             (scripts/gpu_vllm_backends.py --device cuda); only with a CUDA build of vLLM in
#             PY, else SKIP with the reason (the lent H200 image has none)
# Then one table (scripts/gpu_report.py) and RESULTS/*.csv (default results/gpu), written
# whatever failed; when $OUT is set (the device machine's output folder), the CSVs, the table,
# device.txt and one log of every step are copied there too. TRITON_INTERPRET is unset.
#
# Exit status: 0 all selected steps passed or were skipped, 1 a step failed or timed out,
# 2 bad arguments or a --python that does not run. --dry-run prints each step's command and
# runs none (no GPU needed; its table goes to a temporary folder unless --results is given).
set -uo pipefail
# the compiled Triton kernel, not its interpreter (which the CPU test suite sets for itself)
unset TRITON_INTERPRET

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALL_STEPS="env install tests quant cuda_ipc nixl worker_cuda vllm_backends"
# time limits (s); their sum, 600 s, bounds the whole run at 10 minutes. Sized from CPU runs here:
# the cuda_ipc step's job (4 updates, each verified against a CPU oracle in every inference
# process) took 91 s on a loaded 2-core VM with all 5 processes on 2 cores; the tests step
# runs 2 small trials of its own besides the transport and kernel tests; vllm_backends (a few
# seconds when it skips) took 57 s here for one backend on the CPU (vLLM import, the fresh engines,
# one engine start); on a GPU each backend is one engine start more. worker_cuda (two python
# processes, a 6-parameter module) took 4-6 s here with --device cpu; its 30 s came from env
# (20 -> 15), quant (75 -> 65) and vllm_backends (120 -> 105), none of them run on a GPU yet.
declare -A LIMIT=([env]=15 [install]=60 [tests]=150 [quant]=65 [cuda_ipc]=110 [nixl]=65 [worker_cuda]=30 [vllm_backends]=105)

PY="${PYTHON:-python3}"
RESULTS="$ROOT/results/gpu"
RESULTS_SET=0
WHEELS="$ROOT/.whl"
SITE="${GPU_CHECK_SITE:-/tmp/wt-gpu-site}"
DRY=0
STEPS="$ALL_STEPS"

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; echo "see: scripts/gpu_check.sh --help" >&2; exit 2; }
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --steps) need_arg "$@"; STEPS="${2//,/ }"; shift ;;
    --steps=*) STEPS="${1#--steps=}"; STEPS="${STEPS//,/ }"; [ -n "$STEPS" ] || die "--steps needs a value" ;;
    --results) need_arg "$@"; RESULTS="$2"; RESULTS_SET=1; shift ;;
    --results=*) RESULTS="${1#--results=}"; RESULTS_SET=1; [ -n "$RESULTS" ] || die "--results needs a value" ;;
    --python) need_arg "$@"; PY="$2"; shift ;;
    --python=*) PY="${1#--python=}" ;;
    --wheels) need_arg "$@"; WHEELS="$2"; shift ;;
    --wheels=*) WHEELS="${1#--wheels=}" ;;
    --site) need_arg "$@"; SITE="$2"; shift ;;
    --site=*) SITE="${1#--site=}" ;;
    --list) for s in $ALL_STEPS; do echo "$s ${LIMIT[$s]}"; done; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done

for s in $STEPS; do
  case " $ALL_STEPS " in *" $s "*) ;; *) die "unknown step '$s' (steps: ${ALL_STEPS// /,})" ;; esac
done
[ -n "${STEPS// /}" ] || die "--steps selects nothing"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null \
  || die "--python '$PY' does not run, or is older than Python 3.10"
selected() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# a dry run never overwrites the committed results unless --results says so
if [ "$DRY" = 1 ] && [ "$RESULTS_SET" = 0 ]; then RESULTS="$(mktemp -d)"; fi
mkdir -p "$RESULTS/logs" || die "cannot create $RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
STEPS_TSV="$RESULTS/steps.tsv"
: >"$STEPS_TSV"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# the project itself is one installed namespace, weight_transfer (pyproject.toml's package-dir maps
# the folders): an editable install of this checkout into $PY unless it imports already; offline
# (--no-deps --no-build-isolation: needs setuptools >= 68 in $PY, nothing is downloaded)
if [ "$DRY" != 1 ] && ! $PY -c "import weight_transfer" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >"$RESULTS/logs/install_project.log" 2>&1 \
    || die "cannot install this checkout into $PY (pip install -e $ROOT; see $RESULTS/logs/install_project.log)"
fi
export PYTHONUNBUFFERED=1

# record NAME STATUS SECONDS RC LOG COMMAND
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" >>"$STEPS_TSV"; }

# step NAME COMMAND...: run under the step's time limit, log to RESULTS/logs/NAME.log
step() {
  local name="$1"; shift
  local cmd="$*" log="$RESULTS/logs/$name.log"
  if ! selected "$name"; then return 0; fi
  if [ "$DRY" = 1 ]; then
    echo "[dry-run] $name (limit ${LIMIT[$name]} s): $cmd"
    record "$name" SKIP 0 0 "" "dry-run: $cmd"
    return 0
  fi
  echo "== $name (limit ${LIMIT[$name]} s): $cmd"
  local t0 t1 rc status
  t0=$(date +%s.%N)
  timeout --kill-after=10 "${LIMIT[$name]}" bash -c "$cmd" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  tail -n 25 "$log"
  case $rc in
    0) status=PASS ;;
    124|137) status=TIMEOUT ;;
    77) status=SKIP ;;  # the step said why it cannot run here (its log's last line)
    *) status=FAIL ;;
  esac
  record "$name" "$status" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')" "$rc" "$log" "$cmd"
  echo "== $name: $status (exit $rc)"
}

# ---- the steps' commands (each one line of bash, run by `step`) ------------------------------

ENV_CMD="set -o pipefail; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1 > '$RESULTS/device.txt' \
&& nvidia-smi && $PY -c 'import sys, torch; print(sys.version.split()[0]); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)' | tee -a '$RESULTS/device.txt'"

# install: whatever `import` cannot find; wheels from WHEELS (no index, no deps: the folder holds
# every wheel needed, scripts/gpu_wheels.sh) into SITE on PYTHONPATH, else pip from the registries
# (one retry, 15 s per connection: a machine without network fails fast instead of at the limit).
# The same checks run again afterwards (SITE on PYTHONPATH): the step passes only when nothing is
# missing any more, whatever pip said.
MISSING_FN="missing=''; \
$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || missing=\"\$missing \${TORCH_SPEC:-torch}\"; \
$PY -c 'import triton' 2>/dev/null || missing=\"\$missing triton\"; \
$PY -c 'import zmq' 2>/dev/null || missing=\"\$missing pyzmq\"; \
$PY -c 'import submitit' 2>/dev/null || missing=\"\$missing submitit\"; \
$PY -c 'import pytest_timeout' 2>/dev/null || missing=\"\$missing pytest-timeout\"; \
$PY -c 'import importlib, importlib.util, sys; [importlib.import_module(m + \"._api\") for m in (\"nixl\", \"nixl_cu12\", \"nixl_cu13\") if importlib.util.find_spec(m)][:1] or sys.exit(1)' 2>/dev/null \
  || missing=\"\$missing \$($PY -c 'import torch; print(\"nixl-cu13\" if (torch.version.cuda or \"\").startswith(\"13\") else \"nixl-cu12\")' 2>/dev/null || echo nixl-cu12)\""
INSTALL_CMD="set -e; $MISSING_FN; \
echo \"missing:\${missing:- nothing}\"; [ -z \"\$missing\" ] && exit 0; \
if ls '$WHEELS'/*.whl >/dev/null 2>&1; then \
  echo 'installing every wheel in $WHEELS into $SITE'; \
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' '$WHEELS'/*.whl; \
else \
  echo 'no wheels in $WHEELS: installing from the package registries'; \
  $PY -m pip install -q --retries 1 --timeout 15 \$missing; \
fi; \
export PYTHONPATH=\"\$PYTHONPATH:$SITE\"; $MISSING_FN; \
if [ -n \"\$missing\" ]; then echo \"still missing after the install:\$missing\"; exit 1; fi; echo 'installed: nothing missing'"

# tests: only the files that hold GPU-marked tests are collected (a module that cannot be imported
# here for an unrelated reason does not stop the step); a GPU test skipped on a GPU machine fails
# the step (gpu_report.py --junit), and one row per test goes to RESULTS/gpu_tests.csv
GPU_TEST_FILES="$(cd "$ROOT" && grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort | tr '\n' ' ')"
TESTS_CMD="rm -f '$RESULTS/gpu_tests.xml' '$RESULTS/gpu_tests.csv'; $PY -m pytest -q -m gpu -p no:cacheprovider \
--junitxml='$RESULTS/gpu_tests.xml' $GPU_TEST_FILES; rc=\$?; \
$PY scripts/gpu_report.py --junit '$RESULTS/gpu_tests.xml' '$RESULTS/gpu_tests.csv' || rc=1; exit \$rc"
# the benchmark: `weight-transfer bench-quant` (run as a module of $PY, which may not have the console script on PATH)
BENCH_QUANT="-m weight_transfer.experiments bench-quant"
QUANT_CMD="rm -f '$RESULTS/quant_bench.csv'; $PY $BENCH_QUANT --device cuda --repeats 10 --out '$RESULTS/quant_bench.csv'"
# the main job (README) with every process on the GPU; --timeout 60: a control-plane wait that
# hangs names the missing rank inside the step's limit instead of being killed silently
CUDA_IPC_CMD="rm -f '$RESULTS/main_cuda_ipc.csv'; $PY -m weight_transfer.experiments run --device cuda --transport cuda_ipc \
--steps 3 --warmup 1 --timeout 60 --results '$RESULTS/main_cuda_ipc.csv'"
NIXL_CMD="rm -f '$RESULTS/nixl_cuda.csv'; $PY scripts/gpu_nixl_check.py --out '$RESULTS/nixl_cuda.csv'"
# the vLLM worker engine's registration over a CUDA module (exit 77 = SKIP without CUDA, the reason last)
WORKER_CUDA_CMD="$PY scripts/gpu_worker_receive.py --device cuda --timeout 20"
# vLLM's backends beside ours: only where PY has a CUDA build of vLLM (exit 77 = SKIP, the reason
# as the log's last line). The H200 image has no vLLM, and a CUDA vLLM wheel (~400 MB) is over the
# 64 MiB a device call carries, so there this step skips until an image brings one.
VLLM_PROBE="$PY -c 'import vllm, sys, torch; from vllm.platforms import current_platform as p; \
print(\"vllm\", vllm.__version__, type(p).__name__, \"cuda\", torch.cuda.is_available()); \
sys.exit(0 if p.is_cuda() and torch.cuda.is_available() else 3)'"
VLLM_BACKENDS_CMD="rm -f '$RESULTS/vllm_backends.csv'; probe=\$($VLLM_PROBE 2>&1); \
if [ \$? -ne 0 ]; then echo \"skipped: no CUDA vLLM in $PY (\$(echo \"\$probe\" | tail -n 1)); \
the H200 image has none; a vLLM wheel (~400 MB) > the 64 MiB a device call carries\"; exit 77; fi; echo \"\$probe\"; \
$PY scripts/gpu_vllm_backends.py --device cuda --updates 3 --timeout 60 --out '$RESULTS/vllm_backends.csv'"

step env "$ENV_CMD"
step install "$INSTALL_CMD"
# wheels installed with --target live in SITE: every later step sees them
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
step tests "$TESTS_CMD"
step quant "$QUANT_CMD"
step cuda_ipc "$CUDA_IPC_CMD"
step nixl "$NIXL_CMD"
step worker_cuda "$WORKER_CUDA_CMD"
step vllm_backends "$VLLM_BACKENDS_CMD"

echo
"$PY" "$ROOT/scripts/gpu_report.py" "$STEPS_TSV" "$RESULTS" | tee "$RESULTS/table.txt"
rc=${PIPESTATUS[0]}

if [ -n "${OUT:-}" ] && [ "$DRY" = 0 ]; then
  # at most 8 files come back from $OUT: the CSVs (summary, gpu_tests, quant_bench,
  # main_cuda_ipc, nixl_cuda), the table, device.txt and one log of every step; vllm_backends.csv
  # would be a ninth: its rows are in that log (gpu_vllm_backends.py prints every row and its table)
  mkdir -p "$OUT" && for f in "$RESULTS"/*.csv "$RESULTS/table.txt"; do
    case "$f" in */vllm_backends.csv) ;; *) [ -f "$f" ] && cp "$f" "$OUT/" ;; esac
  done
  [ -f "$RESULTS/device.txt" ] && cp "$RESULTS/device.txt" "$OUT/"
  for f in "$RESULTS"/logs/*.log; do [ -f "$f" ] && { echo "==== $f"; cat "$f"; }; done >"$OUT/gpu_check.log"
fi
exit "$rc"
