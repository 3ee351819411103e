# The two commands: `make run` (set up, start TorchServe + Packrat with the demo
# models) and `make test` (the whole test suite). `make stop` stops the server.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# The TorchServe endpoint plugin (/packrat/... on the management port): rebuilt
# when a source changes; without javac the script says so and setup goes on.
PLUGIN_JAR := plugin/build/packrat-plugin.jar
PLUGIN_SRC := $(shell find plugin/src plugin/resources -type f) scripts/build_plugin.sh

.PHONY: setup plugin run test test-random bench stop clean

setup: $(VENV)/.installed $(PLUGIN_JAR)

plugin: $(PLUGIN_JAR)

# After the venv (setup lists it first): the build compiles against its model-server.jar.
$(PLUGIN_JAR): $(PLUGIN_SRC)
	@scripts/build_plugin.sh

$(VENV)/.installed: pyproject.toml
	@scripts/check_java.sh
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required (set PYTHON=/path/to/python3.11)"'
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,runtimes]'
	touch $@

run: setup
	scripts/run_demo.sh

test: setup
	$(BIN)/python -m pytest -q

# The suite with test files and the tests in each shuffled (pytest-random-order; the
# seed is printed: rerun with SEED=<it>). Order dependence shows up here, not in `make test`.
SEED ?= $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
test-random: setup
	$(BIN)/python -m pytest -q -p random_order --random-order-bucket=module --random-order-seed=$(SEED)

# The side-by-side benchmark, full mode (docs/benchmarks.md): with a tune per model up to ~100 min on 2 cores (--no-tuned: ~40).
bench: setup
	$(BIN)/packrat bench --full --out bench-out/full

# Not `torchserve --stop`: it stops whatever server /tmp/.model_server.pid names,
# which may be another instance (tests, another checkout). This stops ours only.
stop:
	-scripts/stop_demo.sh

clean: stop
	rm -rf model-store/*.mar model-store/*/ logs .packrat plugin/build
