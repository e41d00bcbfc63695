"""Helpers for tests: tolerances, and tokamax's Mosaic KDA kernel on CPU.

`mosaic_interpret_mode()` is the one documented switch that lets the real
tokamax Pallas/Mosaic kernel run off-TPU: inside it, Pallas calls run in
interpret mode (tokamax reads `PALLAS_INTERPRET=1`), the kernel's VMEM sizing
sees TPU v6e hardware info, and tokamax's device check accepts the CPU. The
kernel code path is the one a TPU runs; only the lowering differs.
"""

import contextlib
import os
import threading
from unittest import mock

import jax
from jax.experimental.pallas import tpu as pltpu
import numpy as np

_state = threading.local()


def mosaic_interpret_active() -> bool:
  """Whether the calling thread is inside `mosaic_interpret_mode()`."""
  return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def mosaic_interpret_mode(chip=pltpu.ChipVersion.TPU_V6E):
  """Runs tokamax's Mosaic KDA kernel in Pallas interpret mode on any device.

  Args:
    chip: the TPU whose limits (VMEM, lanes, sublanes) the kernel's sizing
      heuristics see; default TPU v6e, the first generation tokamax supports.

  Yields:
    None. Calls made inside may use `backend="mosaic"` on CPU. Each interpret
    call takes seconds: keep shapes small.
  """
  # Imported here so that importing this module does not need tokamax's
  # Pallas TPU modules unless the context is used.
  from tokamax._src.ops.kda import pallas_mosaic_tpu  # pylint: disable=g-import-not-at-top

  info = pltpu.get_tpu_info_for_chip(chip, 1)
  old = os.environ.get("PALLAS_INTERPRET")
  os.environ["PALLAS_INTERPRET"] = "1"
  _state.depth = getattr(_state, "depth", 0) + 1
  try:
    with mock.patch.object(pltpu, "get_tpu_info", return_value=info), \
         mock.patch.object(
             pallas_mosaic_tpu.PallasMosaicTpuKimiDeltaAttention,
             "supported_on", return_value=True):
      yield
  finally:
    _state.depth -= 1
    if old is None:
      os.environ.pop("PALLAS_INTERPRET", None)
    else:
      os.environ["PALLAS_INTERPRET"] = old


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
