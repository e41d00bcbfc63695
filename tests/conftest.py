"""Test set-up shared by the whole suite.

Multi-device tests run on simulated CPU devices; the flag must be set before
jax is imported, so it lives here, the first file pytest loads.
"""

import os
import shutil
import tempfile

import pytest

# On the CPU (the default platform here) XLA compiles at LLVM's -O1, not
# -O3: the suite is mostly the compilation of small programs, run a few
# times each. Measured on the 2-core host: 11-19% less CPU time in tests
# that compile and run layers, and the chunked op's loss and gradients (B2
# T200 H2 K32) bit for bit those of -O3. (-O0 saved 36-46% but moved
# results: `gates.exp`'s evaluation then 1.06-1.19 ulp where -O3 gave 0.80,
# since it does not fuse multiplies and adds (nor does a TPU; `gates.exp`
# now keeps an ulp either way), and a gradient past its bound; so not
# -O0.) A TPU run (JAX_PLATFORMS=tpu,cpu,
# tests/tpu.sh) keeps XLA's defaults.
_CPU_ONLY = os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8"
                      + (" --xla_backend_optimization_level=1"
                         if _CPU_ONLY else ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
  """One persistent JAX compilation cache for the whole run, shared by the
  command lines the tests start (they inherit the environment): the many
  runs of the same smoke configs then compile once. A cache already named
  in the environment is used as it is.

  On the CPU the test processes themselves write no entries: twice a CI
  run on the 2-core host lost an xdist worker to a segmentation fault in
  jaxlib's `executable.serialize()`, the cache's write of a CPU executable
  (in `test_kda_randomized`, then in
  `test_packed_segments_in_bfloat16_at_one_pass`), and xdist hung once
  after it. Their programs are mostly each test's own, so little is lost;
  a TPU run (tests/tpu.sh) keeps the cache between its pieces."""
  if _CPU_ONLY:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_enable_compilation_cache", False)
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
