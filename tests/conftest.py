"""Test set-up shared by the whole suite.

Multi-device tests run on simulated CPU devices; the flag must be set before
jax is imported, so it lives here, the first file pytest loads.
"""

import gc
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
# -O0.) The workers that died inside XLA's compiles were out of memory
# maps, at any level (`release_programs`, below). A TPU run
# (JAX_PLATFORMS=tpu,cpu, tests/tpu.sh) keeps XLA's defaults.
_CPU_ONLY = os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8"
                      + (" --xla_backend_optimization_level=1"
                         if _CPU_ONLY else ""))
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


# Every program a process has compiled stays in memory while JAX's caches
# hold it, and XLA's CPU backend maps each compiled kernel's code and data
# separately: one interpret-mode test of the Pallas kernels leaves about
# 1,200 memory maps behind, and an xdist worker gained about 50 a second in
# those tests. Linux allows a process vm.max_map_count of them (65,530 by
# default); past it XLA cannot map a new program and dies inside the compile
# or the compilation cache's serialization (`LLVM ERROR: Unable to allocate
# section memory`, an abort, or a segmentation fault), as xdist workers did
# about halfway through the suite, and as one process did at once with the
# limit lowered to 3,000. So after each test a process past half its limit
# drops JAX's caches (the persistent cache on disk keeps the programs).
_MAPS = "/proc/self/maps"
_MAP_LIMIT = "/proc/sys/vm/max_map_count"


def memory_maps():
  """This process's memory maps, or None where /proc does not count them."""
  try:
    with open(_MAPS, "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


def map_limit():
  """The kernel's limit on a process's memory maps (None if unknown)."""
  try:
    with open(_MAP_LIMIT, encoding="utf-8") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def release_programs(limit=None):
  """Drops JAX's caches (and with them the compiled programs no one else
  holds) if this process has more than half of `limit` memory maps (default
  `map_limit()`). Returns whether it did."""
  limit, maps = limit or map_limit(), memory_maps()
  if not limit or maps is None or maps <= limit // 2:
    return False
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  gc.collect()
  return True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
  del item
  release_programs()
