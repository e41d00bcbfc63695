"""Test tolerances and comparisons (relative L2 errors), for the tests only.

Nothing in the library imports this module.
"""

import contextlib

import jax
import numpy as np


def relative_l2_error(actual, expected) -> float:
  """||actual - expected|| / max(||expected||, tiny), in float64."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  denom = max(float(np.linalg.norm(expected)), 1e-30)
  return float(np.linalg.norm(actual - expected)) / denom


# Relative L2 error allowed between two implementations of the same op.
RTOL = {np.dtype("float32"): 1e-5, np.dtype("bfloat16"): 2e-2}


def assert_close(actual, expected, *, rtol: float, name: str = "value"):
  """Asserts a relative L2 error <= rtol, with the error in the message."""
  actual = np.asarray(jax.device_get(actual), np.float64)
  expected = np.asarray(jax.device_get(expected), np.float64)
  if actual.shape != expected.shape:
    raise AssertionError(
        f"{name}: shape {actual.shape} != expected {expected.shape}")
  if not np.all(np.isfinite(actual)):
    raise AssertionError(f"{name}: non-finite values in the result")
  err = relative_l2_error(actual, expected)
  if not err <= rtol:
    raise AssertionError(f"{name}: relative L2 error {err:.3e} > {rtol:.1e}")


@contextlib.contextmanager
def float64_on_host():
  """float64 on (`jax.enable_x64`) and the host's CPU the default device:
  for oracles and float64 tests on any host. A TPU has no native float64
  (XLA emulates it: a float64 finite-difference test took 137 s on a v5e,
  docs/tpu.md), and a float64 oracle should not share the device under
  test."""
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    yield


def pallas_interpret() -> bool:
  """`interpret=` for our Pallas kernels in tests: True (Pallas interpret
  mode) unless the default backend is a TPU, where the compiled kernel
  runs. Interpret mode on a TPU runs the kernel's body as XLA ops on the
  chip at its default precision, which are neither the kernel's numbers
  nor a CPU's: on a v5e 28 float32 tests of
  tests/ops/test_kda_pallas_batched.py missed 1e-5 on the output by
  2.6e-4..6.6e-4 that way."""
  return jax.default_backend() != "tpu"
