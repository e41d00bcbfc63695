"""The batched-heads Pallas TPU KDA kernel (`ops/kda/pallas_batched.py`).

In interpret mode on CPU: outputs and final states against the float64
NumPy recurrence, every gradient (its backward kernel) against the float64
`reference` op (whose gradients are anchored by float64 finite differences),
on prepared inputs as in `test_kda_pallas.py` (whose helpers this file
shares); the export to Mosaic for TPU v5e and v6e; the limits. Measured here
(CPU, interpret mode, K = V = 128): float32 at HIGHEST 1.9e-7..3.8e-7 on the
output, gradients 2e-7..5e-7 except dg with every g at -5 (5.8e-6, an
ill-conditioned case: the first kernel gives 6.6e-6 there).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import testing
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import pallas_batched
from linear_attention.ops.kda.precision import ACCURATE, FAST
from tests.ops.test_kda_pallas import (RTOL_BF16_OUT, RTOL_F32, _grads_pair,
                                       oracle, prepared)

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


def run(args, **kw):
  kw.setdefault("precision", ACCURATE)
  o, state = pallas_batched.kda_forward(*args, interpret=True, **kw)
  assert state.dtype == jnp.float32 and o.dtype == args[0].dtype
  return o, state


@pytest.mark.parametrize("t, g, beta, init, h, hb", [
    (64, (-5.0, 0.0), None, False, 2, 2),
    (100, (-5.0, 0.0), None, True, 4, 2),  # padded; two head blocks
    (192, (-5.0, -5.0), None, True, 2, 2),  # every g at the limit
    (192, (-1e-3, 0.0), None, True, 2, 1),  # almost no decay
    (100, (-1e-3, 0.0), 0.0, True, 2, 2),  # no writes: the decayed state
])
def test_matches_the_float64_recurrence(t, g, beta, init, h, hb):
  args = prepared(t, g=g, beta=beta, init=init, h=h)
  o, state = run(args, heads_per_block=hb)
  o_ref, s_ref = oracle(*args)
  testing.assert_close(o, o_ref, rtol=RTOL_F32, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_F32, name="final_state")


def test_bfloat16_inputs_at_one_pass():
  q, k, v, g, beta, s0 = prepared(100, seed=3)
  bf = lambda x: x.astype(jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), g, bf(beta), s0)
  o, state = run(args, precision=FAST)
  o_ref, s_ref = oracle(*args)  # the recurrence on the rounded inputs
  testing.assert_close(o, o_ref, rtol=RTOL_BF16_OUT, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_BF16_OUT, name="final_state")


@pytest.mark.parametrize("t, g, beta, init, chunk, h, b, hb", [
    (100, (-5.0, 0.0), None, True, 64, 2, 1, None),
    (192, (-5.0, -5.0), None, False, 64, 2, 1, None),
    (160, (-1e-3, 0.0), None, True, 32, 2, 1, None),
    (100, (-1.0, 0.0), 1.0, True, 64, 2, 1, None),
    (200, (-5.0, 0.0), None, True, 128, 4, 2, 2),  # B = 2, two head blocks
])
def test_gradients_match_the_float64_reference(t, g, beta, init, chunk, h, b,
                                               hb):
  args = prepared(t, g=g, beta=beta, init=init, seed=6, h=h, b=b)
  (out, grads), (out64, grads64) = _grads_pair(
      args, forward=pallas_batched.kda_forward, chunk=chunk,
      heads_per_block=hb)
  for name, x, w in zip(("output", "final_state"), out, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  for name, x, w in zip(NAMES, grads, grads64):
    assert x.dtype == jnp.float32, name
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


def test_gradients_of_bfloat16_inputs():
  q, k, v, g, beta, s0 = prepared(100, h=4, seed=7)
  bf = lambda x: x.astype(jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), g, bf(beta), s0)
  (_, grads), (_, grads64) = _grads_pair(
      args, forward=pallas_batched.kda_forward, precision=FAST,
      heads_per_block=2)
  dtypes = (jnp.bfloat16,) * 3 + (jnp.float32, jnp.bfloat16, jnp.float32)
  for name, x, w, dtype in zip(NAMES, grads, grads64, dtypes):
    assert x.dtype == dtype, name
    # One bfloat16 pass, gradients rounded to bfloat16: the first kernel's
    # bound (its measured 2.4e-3..4.0e-3, twice the largest).
    testing.assert_close(x, np.asarray(w), rtol=8e-3, name=name)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_backward_export_to_mosaic_for_tpu(chip, dtype):
  b, t, h, kd = 1, 256, 8, 128
  s = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  args = (s(b, t, h, kd), s(b, t, h, kd), s(b, t, h, kd),
          s(b, t, h, kd, d=jnp.float32), s(b, t, h, d=jnp.float32),
          s(b, h, kd, kd, d=jnp.float32))
  precision = ACCURATE if dtype == jnp.float32 else FAST
  fwd = lambda *a: pallas_batched.kda_forward(*a, precision=precision,
                                              lower_bound=-5.0)
  loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in fwd(*a))
  with mosaic.lowering_mode(chip):
    forward = jax.export.export(jax.jit(fwd), platforms=["tpu"])(*args)
    grads = jax.export.export(jax.jit(jax.grad(loss, argnums=range(6))),
                              platforms=["tpu"])(*args)
  assert forward.mlir_module().count("tpu_custom_call") == 1
  assert [a.shape for a in forward.out_avals] == [(b, t, h, kd),
                                                  (b, h, kd, kd)]
  assert grads.mlir_module().count("tpu_custom_call") == 2
  assert [a.shape for a in grads.out_avals] == [x.shape for x in args]


def test_limits_raise_not_implemented():
  args = prepared(64)
  with pytest.raises(NotImplementedError, match="heads_per_block"):
    run(args, heads_per_block=3)
  with pytest.raises(NotImplementedError, match="power of two"):
    run(args, chunk=48)
  with pytest.raises(NotImplementedError, match="lower_bound"):
    run(args, lower_bound=-6.0)
