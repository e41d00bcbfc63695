"""Tests for the `ShortConvolution` Haiku module."""

from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import testing
from linear_attention.modules import ShortConvolution
from tests.ops.test_short_conv import conv_numpy


def _x(b=2, t=11, c=6, seed=0):
  return np.random.default_rng(seed).normal(size=(b, t, c)).astype(np.float32)


class ShortConvolutionTest(chex.TestCase):

  @hk.testing.transform_and_run
  def test_parameters_and_init_range(self):
    conv = ShortConvolution(4, use_bias=True, name="conv")
    conv(jnp.asarray(_x(c=64)))
    params = conv.params_dict()
    chex.assert_trees_all_equal_shapes(
        dict(params), {"conv/w": np.zeros((4, 64)), "conv/b": np.zeros(64)})
    w = np.asarray(params["conv/w"])
    assert np.all(np.abs(w) <= 0.5) and w.std() > 0.2  # U(-1/2, 1/2), W = 4
    assert np.all(np.asarray(params["conv/b"]) == 0)  # exact: jnp.zeros

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(dict(use_bias=False, activation="silu"),
                            dict(use_bias=True, activation=None))
  def test_forward_matches_numpy_with_segments(self, use_bias, activation):
    f = hk.transform(lambda x, s: ShortConvolution(
        3, use_bias=use_bias, activation=activation)(x, segment_ids=s))
    x = _x()
    seg = np.array([[1] * 4 + [2] * 5 + [0] * 2, [0] + [1] * 10], np.int32)
    params = f.init(jax.random.key(0), x, seg)
    if use_bias:  # make the bias matter
      params = jax.tree.map(lambda p: p + 0.3, params)
    y = self.variant(f.apply)(params, None, x, seg)
    p = params["short_convolution"]
    want = conv_numpy(x, p["w"], seg, activation, p.get("b"))
    testing.assert_close(y, want, rtol=1e-6, name="y")

  @chex.variants(with_jit=True, without_jit=True)
  def test_decode_with_cache_equals_full_sequence(self):
    def fwd(x, cache):
      conv = ShortConvolution(4)
      if cache is None:
        return conv(x)
      return conv(x, cache=cache)
    f = hk.transform(fwd)
    x = _x()
    params = f.init(jax.random.key(1), x, None)
    full = f.apply(params, None, x, None)
    step = self.variant(f.apply)
    cache = jnp.zeros((2, 3, 6))
    y0, cache = step(params, None, x[:, :5], cache)  # prefill of 5
    ys = [y0]
    for t in range(5, 11):  # then token by token
      y, cache = step(params, None, x[:, t:t + 1], cache)
      ys.append(y)
    testing.assert_close(jnp.concatenate(ys, 1), full, rtol=1e-6, name="y")
    want = conv_numpy(x, params["short_convolution"]["w"])
    testing.assert_close(full, want, rtol=1e-6, name="full")

  @parameterized.parameters(0, -1, 2.0)
  def test_bad_kernel_size(self, kernel_size):
    with pytest.raises(ValueError, match="^kernel_size "):
      hk.transform(lambda: ShortConvolution(kernel_size)).init(None)

  def test_bad_activation(self):
    with pytest.raises(ValueError, match="^activation "):
      hk.transform(lambda: ShortConvolution(4, activation="gelu")).init(None)
