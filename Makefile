# Two commands do all set-up on a fresh machine with python3.12 on the PATH:
#   make experiment   # the default experiment (creates .venv when missing)
#   make test         # the test suite (creates .venv when missing)
# Both install the locked, tested versions (requirements/lock.txt);
# `make lock` refreshes the lock (JAX=<version> picks the JAX it pins).
PYTHON ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs
PYTHON_TPU ?= $(BIN)/python

.PHONY: test test-tpu experiment venv lock clean bundles

venv: $(STAMP)

$(STAMP): setup.py requirements/lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements/lock.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Rewrites requirements/lock.txt and lock-tpu.txt from a throwaway venv.
JAX ?= 0.12.0.1
lock:
	JAX=$(JAX) PYTHON=$(PYTHON) requirements/refresh.sh

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=20 tests

# On a TPU host (after `pip install -r requirements/lock-tpu.txt` and
# `pip install --no-deps -e .`): the suite on the chip, one process a piece
# (one process holds the chip; tests/tpu.sh; PIECES=ops_kda runs one), compiled programs cached
# on disk; per-run outcomes in tpu-tests-<piece>-<time>.xml, per piece in
# tpu-ledger-<piece>.tsv (a cut piece resumes when run again).
PIECES ?=
test-tpu:
	PYTHON=$(PYTHON_TPU) tests/tpu.sh $(PIECES)

# The kernels' static schedules for a TPU v5e on any host: the locked libtpu
# (not installed: unpacked into .libtpu/) compiles them for a compile-only
# v5e, and benchmarks/kda_kernel_bundles.py counts their VLIW bundles.
LIBTPU_WHEEL := $(shell sed -n 's/^libtpu==//p' requirements/lock-tpu.txt)
.libtpu/libtpu/libtpu.so:
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: \
	  --python-version 3.12 --platform manylinux_2_31_x86_64 -d .libtpu \
	  libtpu==$(LIBTPU_WHEEL)
	$(BIN)/python -m zipfile -e .libtpu/libtpu-$(LIBTPU_WHEEL)-*.whl .libtpu
	touch $@

bundles: $(STAMP) .libtpu/libtpu/libtpu.so
	$(BIN)/python -m benchmarks.kda_kernel_bundles \
	  --out=$(WORKDIR)/kda_kernel_bundles --libtpu=.libtpu/libtpu/libtpu.so

experiment: $(STAMP)
	$(BIN)/python -m experiments.ablate --config=configs/mqar.py --mixers=kda,kda_zeroed --workdir=$(WORKDIR)/mqar_ablation

clean:
	rm -rf $(VENV) *.egg-info .libtpu
