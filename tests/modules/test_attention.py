"""Tests for the attention mixer's dtypes: RoPE and the layer keep x's.

A bfloat16 q or k that RoPE returned in float32 made the rest of a bfloat16
model float32 against bfloat16 weights (mixed dots, HIGHEST on a TPU;
tests/test_precision.py reads them in the TPU's lowering).
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import modules
from linear_attention.modules import attention

DTYPES = ("float32", "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_returns_xs_dtype(dtype):
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8), dtype)
  y = attention.rope(x, 10_000.0, offset=3)
  assert y.dtype == jnp.dtype(dtype), y.dtype
  # The rotation runs in float32 either way (a bfloat16 x is exact there):
  # the bfloat16 result is the float32 one rounded, bit for bit.
  want = attention.rope(x.astype(jnp.float32), 10_000.0, offset=3)
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(want.astype(dtype), np.float32))


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_returns_xs_dtype(dtype, cached):
  dtype = jnp.dtype(dtype)
  layer = lambda: modules.ShortConvSoftmaxAttention(num_heads=2, head_dim=8)
  f = hk.transform(lambda x, c: layer()(x, cache=c))
  x = jax.random.normal(jax.random.key(0), (2, 6, 16), dtype)
  cache = (attention.init_attention_cache(
      2, num_heads=2, head_dim=8, conv_size=4, max_len=8, dtype=dtype)
           if cached else None)
  params = jax.tree.map(lambda p: p.astype(dtype),
                        f.init(jax.random.key(1), x, cache))
  y, new_cache = f.apply(params, None, x, cache)
  assert y.dtype == dtype, y.dtype
  if cached:
    assert new_cache.k.dtype == new_cache.v.dtype == dtype, new_cache
