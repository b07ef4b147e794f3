# tfdist — set-up, main job and tests. On a fresh Debian box with Python 3.11:
#   make demo   # create .venv, install, train the CNN on real MNIST under 4 replicas
#   make test   # same set-up, then the whole suite (tests and notebooks)
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

# Debian packages the suite needs (later layers append: OpenMPI, SLURM, ...). Installed when missing
# and running as root; otherwise the target names the command to run.
APT_PACKAGES ?=

.PHONY: help setup system-deps demo test quick bench clean

help:
	@echo "make demo    set up .venv and run the main job (MNIST CNN, 4 replicas)"
	@echo "make test    set up .venv and run the whole suite (tests + notebooks)"
	@echo "make quick   the suite without the slow multi-process tests"
	@echo "make bench   the benchmarks (JSON and PNG under $(OUT)/)"

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
	  echo "python venv is missing; on Debian: apt-get install python3-venv"; exit 1; }
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[$(TF_EXTRA),test]"
	@rm -f $(VENV)/.installed-*; touch $@

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq -o DPkg::Lock::Timeout=600 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 $$missing; \
	  else echo "missing Debian packages; run: sudo apt-get install $$missing"; exit 1; fi; \
	fi

demo: setup
	$(BIN)/tfdist train --strategy mirrored --replicas 4 --epochs 5 --dataset mnist \
	  --plot $(OUT)/curves.png --json $(OUT)/run.json --save $(OUT)/cnn.keras

test: setup system-deps
	$(BIN)/pytest tests notebooks --nbmake --nbmake-timeout=900 $(PYTEST_ARGS)

quick: setup
	$(BIN)/pytest tests -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(BIN)/tfdist bench overhead --json $(OUT)/bench_overhead.json
	$(BIN)/tfdist bench pipeline --json $(OUT)/bench_pipeline.json --png $(OUT)/bench_pipeline.png

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache build *.egg-info
