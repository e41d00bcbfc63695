"""Test set-up shared by the whole suite.

Multi-device tests run on simulated CPU devices; the flag must be set before
jax is imported, so it lives here, the first file pytest loads.
"""

import os
import shutil
import tempfile

import pytest

# XLA compiles at its default optimization level. (LLVM -O1 on the CPU saved
# 11-19% of CPU time in tests that compile and run layers; it was dropped
# when xdist workers began dying of segmentation faults inside XLA's CPU
# compilation or its serialization of the result, but the crash came back
# at the default level too, in test_pallas_kernels_as_the_per_rank_engine:
# its cause is open. -O0 moved results: `gates.exp` past an ulp, a gradient
# past its bound.)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
  """One persistent JAX compilation cache for the whole run, shared by the
  xdist workers and the command lines the tests start (they inherit the
  environment): the many runs of the same smoke configs then compile once.
  A cache already named in the environment is used as it is."""
  if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in \
      os.environ:
    return
  path = tempfile.mkdtemp(prefix="linear_attention_tests_jax_cache_")
  config.stash[_CACHE_DIR] = path
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_unconfigure(config):
  path = config.stash.get(_CACHE_DIR, None)
  if path:
    shutil.rmtree(path, ignore_errors=True)


# A ledger of finished tests (`LINEAR_ATTENTION_TEST_LEDGER`, set by
# tests/tpu.sh): each test's outcome is appended as it finishes, and a run
# with a ledger skips the tests it already holds. A piece cut by a time limit
# or a crash then resumes where it stopped; nothing finished is run twice.
_LEDGER = "LINEAR_ATTENTION_TEST_LEDGER"


def read_ledger(path):
  """{node id: outcome} of a ledger file (missing: empty)."""
  done = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        parts = line.rstrip("\n").split("\t")
        if len(parts) >= 2:
          done[parts[1]] = parts[0]
  return done


def pytest_collection_modifyitems(config, items):
  path = os.environ.get(_LEDGER)
  if not path:
    return
  done = read_ledger(path)
  keep = [item for item in items if item.nodeid not in done]
  if len(keep) < len(items):
    config.hook.pytest_deselected(
        items=[item for item in items if item.nodeid in done])
    items[:] = keep


def pytest_runtest_logreport(report):
  path = os.environ.get(_LEDGER)
  if not path:
    return
  # One line per test: its failure or skip wherever it happened, else the
  # call's outcome (a teardown error after a pass is recorded as a failure).
  if report.when == "call" or report.outcome != "passed":
    with open(path, "a", encoding="utf-8") as f:
      f.write(f"{report.outcome}\t{report.nodeid}\t{report.duration:.2f}\n")
