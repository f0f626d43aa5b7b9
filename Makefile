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

.PHONY: venv demo test lint fmt bench lock system-deps clean

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
