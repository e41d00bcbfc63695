"""benchmarks/kda_tpu_parts.py's stages of the batched kernel, on a CPU.

Each stage runs in interpret mode at a small shape, and the whole body
(`b_state`) leaves the same final state as the kernel itself (`b_kernel`):
the stages time the kernel's own computation, not a stand-in. No timing is
asserted.
"""

import jax
import numpy as np

from benchmarks import kda_tpu
from benchmarks import kda_tpu_parts
from linear_attention import testing


def test_the_batched_stages_run_and_compose_the_kernel():
  args = kda_tpu.inputs(1, 128, 4, 128, dtype="float32")
  outs = {name: jax.jit(kda_tpu_parts.batched_parts_fn(name, 2))(*args)
          for name in kda_tpu_parts.BATCHED_VARIANTS}
  for name, (o, state) in outs.items():
    assert o.shape == (1, 128, 4, 128), name
    assert np.all(np.isfinite(np.asarray(o))), name
  kernel_state = outs["b_kernel"][1]
  body_state = outs["b_state"][1].reshape(kernel_state.shape)
  testing.assert_close(body_state, kernel_state, rtol=1e-6,
                       name="b_state's final state")
  # Before the state stage nothing reaches the state.
  assert not np.any(np.asarray(outs["b_ut"][1]))
