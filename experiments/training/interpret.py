"""Pallas interpret mode for KDA's `tokamax` backend off TPU.

Runs tokamax's Mosaic KDA kernel on any device (tests on CPU; checking a
config's numbers before paying for a TPU). The kernel code is the one a TPU
runs; only the lowering differs. Seconds per call: keep shapes small.

    from experiments.training import interpret
    with interpret.interpret_mode():          # TPU v6e limits
      o, _ = ops.kimi_delta_attention(..., backend="tokamax")

It lives here, with the programs, because it flips two process-wide switches
that the library never touches (docs/design.md, "Known compromise"):

* tokamax 0.0.17 runs its pallas_calls in interpret mode when the
  environment says `PALLAS_INTERPRET=1`, and has no argument for it;
* it sizes the kernel from `pltpu.get_tpu_info()` at trace time, which off
  TPU describes no chip, and JAX's way to name a TPU off-TPU (an abstract
  mesh, `mosaic.lowering_mode`) forbids running anything. So the lookup is
  replaced for the duration, as tokamax's own tests do.

Both are restored on exit. Inside, the library's `mosaic.interpreted()` lifts
the op's off-TPU check. `mosaic.lowering_mode`, the path to a TPU, needs none
of this.
"""

import contextlib
import os
from unittest import mock

from jax.experimental.pallas import tpu as pltpu

from linear_attention.ops.kda import mosaic

ENV = "PALLAS_INTERPRET"


@contextlib.contextmanager
def interpret_mode(chip="v6e"):
  """Pallas interpret mode, with `chip`'s limits, for `backend="tokamax"`.

  Args:
    chip: the TPU whose limits (VMEM, lanes, sublanes) the kernel's sizing
      heuristics see (a `pltpu.ChipVersion` or a name such as "v6e");
      default TPU v6e, the first generation tokamax supports.

  Yields:
    None. Calls made inside may use `backend="tokamax"` on any device.
  """
  info = pltpu.get_tpu_info_for_chip(mosaic.chip_version(chip), 1)
  old_env = os.environ.get(ENV)
  os.environ[ENV] = "1"
  try:
    with mock.patch.object(pltpu, "get_tpu_info", return_value=info), \
         mosaic.interpreted():
      yield
  finally:
    if old_env is None:
      os.environ.pop(ENV, None)
    else:
      os.environ[ENV] = old_env
