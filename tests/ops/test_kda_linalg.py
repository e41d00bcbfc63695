"""The chunked form's pair sums against float64 loops (value and VJP)."""

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.ops.kda.chunked import linalg


def test_pair_sums_and_their_vjp_match_float64_loops():
  size, blocks = 16, 2
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, size * blocks, 5)).astype(np.float32)
  cot = rng.normal(size=(3, blocks, size, size, 5)).astype(np.float32)
  want = np.zeros(cot.shape)
  want_grad = np.zeros(x.shape)
  x64 = x.astype(np.float64)
  for n in range(blocks):
    for s in range(size):
      for t in range(s):  # (t, s] inside block n; zero where s <= t
        lo, hi = n * size + t + 1, n * size + s + 1
        want[:, n, s, t] = x64[:, lo:hi].sum(axis=1)
        want_grad[:, lo:hi] += cot[:, n, s, t][:, None, :]
  got, vjp = jax.vjp(lambda a: linalg.pair_sums(a, size), jnp.asarray(x))
  (grad,) = vjp(jnp.asarray(cot))
  # float32 sums of <= 15 (value) and <= 120 (VJP) terms of size ~1.
  np.testing.assert_allclose(got, want, rtol=0, atol=15 * 4 * 2.4e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=0, atol=120 * 4 * 2.4e-7)
