# Two commands on a fresh machine:  make demo  |  make test
# Both create .venv, install requirements.txt and fetch the model (into $MINILLM_CACHE or ~/.cache/minillm).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < requirements.txt | cut -d' ' -f1)

.PHONY: demo test setup model gpu-carry gpu-check gpu-notebooks

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(PY) -c "from minillm.loading.loader import fetch_smollm2; print('model:', fetch_smollm2())"

demo: model
	$(PY) -m minillm demo

test: model
	$(PY) -m pytest tests

# A lent CUDA GPU has no package index: `make gpu-carry` here fills .gpu/ (wheels, the model in halves);
# there, call 1 `make gpu-check` (carry .gpu/wheels .gpu/model.1, timeout_s 430), then at once call 2
# `make gpu-notebooks` (carry .gpu/wheels.2 .gpu/model.2, timeout_s 340). tools/gpu_check.py says what each runs.
gpu-carry: model
	$(PY) tools/gpu_carry.py

gpu-check:
	-python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
	PYTHONPATH=/tmp/site:$(CURDIR) python3 tools/gpu_check.py kernels

gpu-notebooks:
	-python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels.2/*.whl
	PYTHONPATH=/tmp/site:$(CURDIR) python3 tools/gpu_check.py notebooks
