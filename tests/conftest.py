"""Test set-up shared by the whole suite.

Multi-device tests run on simulated CPU devices; the flag must be set before
jax is imported, so it lives here, the first file pytest loads.
"""

import os
import shutil
import tempfile

import pytest

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
