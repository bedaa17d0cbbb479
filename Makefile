# Two commands on a fresh machine:  make demo  |  make test
# Both create .venv, install requirements.txt and fetch the model (into $MINILLM_CACHE or ~/.cache/minillm).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < requirements.txt | cut -d' ' -f1)

.PHONY: demo test setup model gpu-check

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(PY) -c "from minillm.loader import fetch_smollm2; print('model:', fetch_smollm2())"

demo: model
	$(PY) -m minillm demo

test: model
	$(PY) -m pytest tests

# On a lent CUDA GPU (no pip there: gguf travels as a wheel in .whl/, see tools/gpu_check.py)
gpu-check:
	python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
	PYTHONPATH=/tmp/site:. python3 tools/gpu_check.py
