"""The compile-ahead wrapper of multi-process steps, in one process.

Across processes `distributed._LinedUp` compiles each new input signature ahead
and lines the processes up before running it (tests/experiments/
test_multiprocess.py runs that for real); here: it computes what the jitted
function computes, compiles once per signature, and lets traced calls
through.
"""

import jax
import jax.numpy as jnp
import numpy as np

from experiments.training import distributed


def test_lined_up_step_compiles_once_per_signature_and_matches_jit():
  traces = []

  def f(x, y):
    traces.append(x.shape)
    return jnp.sin(x) * y.sum()

  step = distributed._LinedUp("f", jax.jit(f))
  x, y = np.arange(6.0).reshape(2, 3), np.ones(4, np.float32)
  # What the jitted function computes on this device (a TPU's float32 sin
  # is not NumPy's float64 one to 1e-6), by a copy that leaves `traces` be.
  want = jax.jit(lambda x, y: jnp.sin(x) * y.sum())(x, y)
  np.testing.assert_allclose(step(x, y), want, rtol=1e-6)
  step(x + 1.0, y)  # same shapes: the compiled step again
  assert len(step.compiled) == 1 and traces == [(2, 3)]
  step(np.ones((5, 3)), y)  # a new shape compiles anew
  assert len(step.compiled) == 2 and traces == [(2, 3), (5, 3)]
  # Inside another trace it is the jitted function.
  np.testing.assert_allclose(jax.jit(step)(x, y), want, rtol=1e-6)
  assert jax.eval_shape(step, x, y).shape == (2, 3)
  distributed.line_up("nobody else")  # one process: returns at once
