"""Tests for `linear_attention.ops.short_conv1d` against a float64 NumPy loop."""

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing


def conv_numpy(x, w, segment_ids=None, activation="silu", bias=None):
  """Float64 loops: y[t] = act(b + sum_s w[W-1-s] x[t-s]) over t's own run."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  b, t, c = x.shape
  width = w.shape[0]
  seg = (np.ones((b, t), np.int64) if segment_ids is None
         else np.asarray(segment_ids, np.int64))
  y = np.zeros((b, t, c))
  for bi in range(b):
    # Number the runs: a new run starts when the non-padding id changes.
    run, last, runs = -1, 0, []
    for ti in range(t):
      if seg[bi, ti] != 0 and seg[bi, ti] != last:
        run, last = run + 1, seg[bi, ti]
      runs.append(run if seg[bi, ti] != 0 else None)
    for ti in range(t):
      if runs[ti] is None:
        continue
      total = 0.0 if bias is None else np.asarray(bias, np.float64).copy()
      for s in range(width):
        if ti - s >= 0 and runs[ti - s] == runs[ti]:
          total = total + w[width - 1 - s] * x[bi, ti - s]
      y[bi, ti] = total * (1 / (1 + np.exp(-total))) if activation else total
  return y


def _inputs(b=2, t=13, c=5, width=4, seed=0):
  r = np.random.default_rng(seed)
  return (r.normal(size=(b, t, c)).astype(np.float32),
          r.normal(size=(width, c)).astype(np.float32),
          r.normal(size=(c,)).astype(np.float32))


# Row 0: two documents with padding inside a run and at the end; row 1:
# leading padding and three short documents (one of length 1).
SEGMENTS = np.array([
    [1, 1, 1, 0, 1, 2, 2, 2, 2, 2, 0, 0, 0],
    [0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3],
], np.int32)


class ShortConvTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(width=(1, 3, 4), activation=("silu", None),
                         segmented=(False, True), use_bias=(False, True))
  def test_matches_numpy_oracle(self, width, activation, segmented, use_bias):
    x, w, bias = _inputs(width=width)
    seg = SEGMENTS if segmented else None
    bias = bias if use_bias else None
    fn = self.variant(lambda x, w, s, b: ops.short_conv1d(
        x, w, segment_ids=s, activation=activation, bias=b))
    y = fn(x, w, seg, bias)
    chex.assert_shape(y, x.shape)
    want = conv_numpy(x, w, seg, activation, bias)
    testing.assert_close(y, want, rtol=1e-6, name="y")

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(
      dict(cuts=(1,), segmented=False),
      dict(cuts=(2, 3, 4, 5, 6, 7), segmented=False),  # token by token
      dict(cuts=(6,), segmented=False),
      # Each piece starts inside a run (or padding) of the one before: the
      # cache does not record ids, so a new document needs a zeroed cache.
      dict(cuts=(3, 7), segmented=True),
      dict(cuts=(9, 10, 11, 12), segmented=True),
      dict(cuts=(3, 4), segmented=True, rows=(0,)),  # an all-padding piece
  )
  def test_cache_continuation_equals_full_sequence(self, cuts, segmented,
                                                   rows=(0, 1)):
    x, w, bias = _inputs()
    x = x[list(rows)]
    seg = SEGMENTS[list(rows)] if segmented else None
    want = conv_numpy(x, w, seg, "silu", bias)
    step = self.variant(lambda x, w, s, c, b: ops.short_conv1d(
        x, w, segment_ids=s, cache=c, bias=b))
    cache = jnp.zeros((x.shape[0], w.shape[0] - 1, x.shape[2]))
    pieces = []
    for lo, hi in zip((0,) + cuts, cuts + (x.shape[1],)):
      y, cache = step(x[:, lo:hi], w, None if seg is None else seg[:, lo:hi],
                      cache, bias)
      chex.assert_shape(cache, (x.shape[0], w.shape[0] - 1, x.shape[2]))
      pieces.append(y)
    testing.assert_close(jnp.concatenate(pieces, 1), want, rtol=1e-6,
                         name="y")

  def test_new_cache_keeps_only_the_last_run(self):
    x, w, _ = _inputs(b=1, t=6, c=3)
    seg = np.array([[1, 1, 1, 2, 0, 2]], np.int32)
    _, cache = ops.short_conv1d(x, w, segment_ids=seg,
                                cache=jnp.zeros((1, 3, 3)))
    # Positions 3, 4, 5: id 2, padding, id 2 -> x[3], 0, x[5].
    want = np.stack([x[0, 3], np.zeros(3), x[0, 5]])[None]
    # exact: the cache copies inputs and writes jnp.where(keep, x, 0) zeros.
    np.testing.assert_array_equal(np.asarray(cache), want)

  def test_other_segments_do_not_leak(self):
    x, w, bias = _inputs()
    f = lambda x: ops.short_conv1d(x, w, segment_ids=SEGMENTS, bias=bias)
    y0 = f(x)
    x1 = np.array(x)
    x1[SEGMENTS == 2] += 10.0  # change document 2 and padding-free others
    x1[SEGMENTS == 0] = 100.0  # and every padding input
    y1 = np.asarray(f(x1))
    outside = (SEGMENTS != 2)
    # exact: the same ops; changed inputs enter other outputs only through
    # jnp.where(visible, x, 0), so those compute the same arithmetic.
    np.testing.assert_array_equal(y1[outside], np.asarray(y0)[outside])
    assert np.all(y1[SEGMENTS == 0] == 0)  # exact: jnp.where(ids != 0, y, 0)
    assert not np.allclose(y1[SEGMENTS == 2], np.asarray(y0)[SEGMENTS == 2])
    # The input gradient of document 1's outputs is zero outside document 1.
    grad = jax.grad(lambda x: jnp.sum(f(x) * (SEGMENTS == 1)[..., None]))(x)
    assert np.all(np.asarray(grad)[SEGMENTS != 1] == 0)  # exact: via where
    assert np.any(np.asarray(grad)[SEGMENTS == 1] != 0)

  def test_bfloat16_output_dtype_and_float32_accumulation(self):
    x, w, _ = _inputs()
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = ops.short_conv1d(xb, wb)
    assert y.dtype == jnp.bfloat16
    want = conv_numpy(np.asarray(xb, np.float32), np.asarray(wb, np.float32))
    # Only the final rounding to bfloat16 (relative 2^-9) separates them.
    testing.assert_close(y, want, rtol=4e-3, name="y")

  @parameterized.parameters(
      dict(kw=dict(x=np.zeros((2, 5))), name="x"),
      dict(kw=dict(w=np.zeros((4, 3))), name="w"),
      dict(kw=dict(w=np.zeros((0, 5))), name="w"),
      dict(kw=dict(segment_ids=np.zeros((2, 4), np.int32)), name="segment_ids"),
      dict(kw=dict(segment_ids=np.zeros((2, 7))), name="segment_ids"),
      dict(kw=dict(cache=np.zeros((2, 4, 5))), name="cache"),
      dict(kw=dict(activation="relu"), name="activation"),
      dict(kw=dict(bias=np.zeros((4,))), name="bias"),
  )
  def test_bad_arguments_raise_value_error(self, kw, name):
    args = dict(x=np.zeros((2, 7, 5), np.float32),
                w=np.zeros((4, 5), np.float32))
    args.update(kw)
    x, w = args.pop("x"), args.pop("w")
    with pytest.raises(ValueError, match=f"^{name} "):
      ops.short_conv1d(x, w, **args)
