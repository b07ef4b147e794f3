# tfdist — set-up, main job and tests. On a fresh Debian box with Python 3.11:
#   make demo   # create .venv with tfdist and TensorFlow only, train the CNN on real MNIST under 4 replicas
#   make test   # everything the suite needs (OpenMPI, SLURM, the Horovod build), then the whole suite
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
# TensorFlow flavour: the CUDA wheel where an NVIDIA driver is present, the CPU wheel elsewhere.
TF_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(TF_EXTRA)
OUT    ?= out
PYTEST_ARGS ?=
# pytest workers for `make test` (tests/conftest.py says why two; 0 runs the suite in one process)
TEST_WORKERS ?= 2

# Debian packages the suite needs (later layers append: OpenMPI, SLURM, ...). Installed when missing
# and running as root; otherwise the target names the command to run.
APT_PACKAGES ?=
# SLURM: controller, node daemon, client commands and munge for the tests on a real SLURM.
APT_PACKAGES += slurm-wlm munge

# The API reference's render check opens a page in headless Chromium.
APT_PACKAGES += chromium

# Horovod (built from source by `make horovod`): OpenMPI, and the compilers/headers its build needs.
APT_PACKAGES += openmpi-bin libopenmpi-dev cmake g++ make python3-dev
HOROVOD_STAMP := $(VENV)/.horovod-$(TF_EXTRA)
KERAS_HUB_STAMP := $(VENV)/.keras-hub

.PHONY: help setup system-deps demo test quick bench clean test-slurm horovod keras-hub bench-allreduce bench-zero bench-zero-horovod api gpu-check

help:
	@echo "make demo    set up .venv and run the main job (MNIST CNN, 4 replicas)"
	@echo "make test    set up .venv and run the whole suite (tests + notebooks)"
	@echo "make quick   the in-process tests only (no Horovod build, no root)"
	@echo "make bench   the benchmarks (JSON and PNG under $(OUT)/)"
	@echo "make api     the API reference from the docstrings, in $(OUT)/api"
	@echo "make gpu-check  every strategy on this machine's GPUs against one GPU (needs NVIDIA GPUs)"

# What every target needs: the venv with tfdist, TensorFlow and the test tools. `make test` adds the
# Debian packages and the Horovod build; the demo needs neither.
setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    rm -rf $(VENV); apt-get update -qq -o DPkg::Lock::Timeout=600 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 python3-venv && \
	    $(PYTHON) -m venv $(VENV); \
	  else echo "python venv is missing; on Debian: sudo apt-get install python3-venv"; exit 1; fi; }
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[$(TF_EXTRA),examples,test]"
	@rm -f $(VENV)/.installed-*; touch $@

# KerasHub, for the tests on the models the Keras ecosystem ships. Its declared dependencies pull tensorflow-text
# and with it a second, full TensorFlow next to tensorflow-cpu: it is installed without them, with what it imports.
keras-hub: $(KERAS_HUB_STAMP)

$(KERAS_HUB_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps keras-hub==0.32.0 regex tokenizers \
	  sentencepiece
	@touch $@

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq -o DPkg::Lock::Timeout=600 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 $$missing; \
	  else echo "missing Debian packages; run: sudo apt-get install $$missing"; exit 1; fi; \
	fi

# Horovod 0.28.1 compiled against this venv's TensorFlow (TensorFlow + MPI + Gloo; GPU: NCCL when
# nvidia-smi is present). The wheel is cached in ~/.cache/tfdist/wheels: only the first run builds (~4 min).
horovod: $(HOROVOD_STAMP)

$(HOROVOD_STAMP): $(STAMP) | system-deps
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[$(TF_EXTRA),horovod]"
	$(BIN)/tfdist build-horovod $(if $(and $(filter gpu,$(TF_EXTRA)),$(shell command -v nvcc 2>/dev/null)),--gpu,)
	@touch $@

demo: setup
	$(BIN)/tfdist train --strategy mirrored --replicas 4 --epochs 5 --dataset mnist \
	  --plot $(OUT)/curves.png --json $(OUT)/run.json --save $(OUT)/cnn.keras

# --no-loadscope-reorder: xdist would otherwise run the units with the most tests first, which put the longest
# units (few tests each) last and left one worker alone at the end; tests/conftest.py orders them longest first.
test: setup system-deps horovod keras-hub
	$(BIN)/pytest tests notebooks --nbmake --nbmake-timeout=900 --durations=30 -n $(TEST_WORKERS) --dist loadgroup \
	  --no-loadscope-reorder $(PYTEST_ARGS)

# In-process tests only: builds nothing beyond the venv (no Horovod, no Debian packages).
quick: setup
	$(BIN)/pytest tests -m "not slow and not horovod and not root" $(PYTEST_ARGS)

bench: setup
	$(BIN)/tfdist bench overhead --json $(OUT)/bench_overhead.json
	$(BIN)/tfdist bench pipeline --json $(OUT)/bench_pipeline.json --png $(OUT)/bench_pipeline.png

# The SLURM tests alone: a real slurmctld + two slurmd in network namespaces; root only.
test-slurm: setup system-deps horovod
	$(BIN)/pytest tests/test_slurm_jobs.py tests/test_slurm_cluster.py tests/test_slurm_ps.py tests/test_preemption.py $(PYTEST_ARGS)

# The API reference from the docstrings (pdoc), links checked: open $(OUT)/api/index.html
api: setup
	$(BIN)/python docs/build_api.py $(OUT)/api

# On a machine with NVIDIA GPUs (setup then installs tensorflow[and-cuda]): each strategy against one GPU, then
# throughput, as a table and $(OUT)/gpu_check.json. Without GPUs it says so and stops.
gpu-check: setup
	$(BIN)/python -m benchmarks gpu-check --json $(OUT)/gpu_check.json

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache build *.egg-info

# ZeRO stages 0/1/2: per-replica memory vs formula, peak RSS per stage, step-time ratios
bench-zero: setup
	$(BIN)/tfdist bench zero --json $(OUT)/bench_zero.json --png $(OUT)/bench_zero.png

# ZeRO stages 0/1/2 as 2 real Horovod processes: peak RSS per process vs the (N-1)/N theory, step time
bench-zero-horovod: setup horovod
	$(BIN)/tfdist bench zero --processes 2 --backend horovod --json $(OUT)/bench_zero_horovod.json \
		--png $(OUT)/bench_zero_horovod.png

# All-reduce bus bandwidth between 2 local processes (TF RING over gRPC)
bench: bench-allreduce
bench-allreduce: setup
	$(BIN)/tfdist bench allreduce --backend tf --json $(OUT)/bench_allreduce.json
