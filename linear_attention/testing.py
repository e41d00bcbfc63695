"""Test tolerances and comparisons (relative L2 errors), for the tests only.

Nothing in the library imports this module.
"""

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
