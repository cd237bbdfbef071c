# Two commands on a fresh machine:
#   make demo   - set everything up, then plan, predict and train on the shipped examples
#   make test   - set everything up, then run the test suite
#   (make test-fast: the suite without the tests marked slow)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of torch is used when available; any torch >= 2.5 works.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,mpi,deepspeed,plot,moo,hf
# The suite runs in this many pytest-xdist processes: two keep a 2-core machine busy while a
# test waits on the ranks or launchers it started (docs/testing.md).
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast clean

$(VENV)/.installed: setup.py
	@echo "== creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "== installing $(TORCH_SPEC) (CPU build where available; the largest download)"
	$(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q "torch>=2.5"
	@echo "== installing hetero (editable) with the extras $(EXTRAS)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $@
	@echo "== installed: the command is $(VENV)/bin/hetero; run '. $(VENV)/bin/activate' to call it as plain 'hetero'"

setup: $(VENV)/.installed

demo: setup
	$(PY) -m hetero validate configs/clusters/*.yaml configs/models/*.yaml configs/examples.yaml
	$(PY) -m hetero devices
	$(PY) -m hetero env
	bash scripts/demo.sh $(PY)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The edit-test loop: every test not marked `slow` (multi-process launches and other long tests).
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
