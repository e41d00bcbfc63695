"""The readable chunked form against the float64 recurrence and `chunked`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda.chunked_naive import kda_chunked_naive
from tests.kda_oracle import kda_numpy


def _inputs(t, chunk_decay, seed=0, b=2, h=2, kd=12, vd=10):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (b, t, h, kd))
  k = jax.random.normal(ks[1], (b, t, h, kd))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], (b, t, h, vd))
  g = chunk_decay * jax.random.uniform(ks[3], (b, t, h, kd))
  beta = jax.random.uniform(ks[4], (b, t, h))
  init = jax.random.normal(ks[5], (b, h, kd, vd))
  return q, k, v, g, beta, init


@pytest.mark.parametrize("t,chunk,decay", [
    (37, 16, -1.0), (64, 64, -5.0), (100, 32, -0.1), (5, 64, -1000.0)])
def test_matches_the_float64_recurrence(t, chunk, decay):
  q, k, v, g, beta, init = _inputs(t, decay)
  o, s = jax.jit(lambda *a: kda_chunked_naive(
      *a[:5], scale=0.3, initial_state=a[5], chunk=chunk))(
          q, k, v, g, beta, init)
  o_np, s_np = kda_numpy(q, k, v, g, beta, scale=0.3, initial_state=init)
  testing.assert_close(o, o_np, rtol=1e-5, name="output")
  testing.assert_close(s, s_np, rtol=1e-5, name="final_state")


def test_matches_the_fast_chunked_backend_and_its_gradients():
  q, k, v, g, beta, init = _inputs(50, -2.0, seed=3)
  cot = jax.random.normal(jax.random.key(9), (2, 50, 2, 10))

  def loss(fn, *a):
    o, s = fn(*a)
    return (o * cot).sum() + s.sum()

  naive = lambda *a: kda_chunked_naive(*a[:5], scale=0.3, initial_state=a[5],
                                       chunk=16)
  fast = lambda *a: ops.kimi_delta_attention(
      *a[:5], scale=0.3, initial_state=a[5], output_final_state=True,
      backend="chunked")
  args = (q, k, v, g, beta, init)
  grads_naive = jax.grad(lambda *a: loss(naive, *a), argnums=range(6))(*args)
  grads_fast = jax.grad(lambda *a: loss(fast, *a), argnums=range(6))(*args)
  for name, x, y in zip(("q", "k", "v", "g", "beta", "initial_state"),
                        grads_naive, grads_fast):
    testing.assert_close(x, y, rtol=1e-5, name=f"d{name}")
  assert np.isfinite(loss(naive, *args))
