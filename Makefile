# Two commands do all set-up on a fresh machine with python3.12 on the PATH:
#   make experiment   # the default experiment (creates .venv when missing)
#   make test         # the test suite (creates .venv when missing)
PYTHON ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs

.PHONY: test experiment venv clean

venv: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=20 tests

experiment: $(STAMP)
	$(BIN)/python -m experiments.ablate --config=configs/mqar.py --mixers=kda,kda_zeroed --workdir=$(WORKDIR)/mqar_ablation

clean:
	rm -rf $(VENV) *.egg-info
