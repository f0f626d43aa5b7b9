# Two commands set up and exercise everything on a fresh machine: `make demo` and `make test`.
# Both bootstrap .venv idempotently (a stamp keyed on the dependency files) and install pinned
# dependencies; without CUDA they take the CPU build of torch so no multi-GB wheel is downloaded.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock 2>/dev/null | sha256sum | cut -c1-12)
SYSTEM_PACKAGES := tmux openssh-server openssh-client lxc lxc-templates
PYTEST_ARGS ?=

.PHONY: venv demo test test-lowest lint fmt bench lock system-deps clean

venv: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA present: installing the CUDA build of torch"; $(PY) -m pip install -q torch; \
	else \
		echo "no CUDA: installing the CPU build ($(TORCH_CPU))"; $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	@$(PY) -m pip install -q -c requirements.lock -e '.[train,dev]'
	@rm -f $(VENV)/.installed-*
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

test: system-deps venv
	@$(PY) -m ruff check .
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
	rm -rf $(VENV) .pytest_cache .ruff_cache
