"""short_conv1d with context_axis inside shard_map vs the single-device op.

Outputs and gradients (x, w, bias; random cotangents, taken outside
shard_map) must equal the single-device conv (relative L2 <= 1e-5), and the
outputs the float64 NumPy loop of tests/ops/test_short_conv.py.
"""

from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from linear_attention import ops
from linear_attention import testing
from tests.ops.test_short_conv import conv_numpy
from tests.parallel import common

AXIS = "context"

# T = 16 over 8 ranks (2 tokens each): with W = 8 a token's 7-token window
# spans up to four ranks. A document crosses several ranks, a boundary falls
# on a split (8), padding sits inside a run and at the end.
SHORT_IDS = np.array([
    [1, 1, 1, 1, 1, 0, 1, 1, 2, 2, 2, 2, 2, 3, 0, 0],
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2],
], np.int32)


def run_conv(x, w, bias, ids, num_ranks, width_activation="silu"):
  conv = lambda x, w, bias, ids: ops.short_conv1d(
      x, w, segment_ids=ids, bias=bias, activation=width_activation,
      context_axis=None if num_ranks is None else AXIS)
  if num_ranks is None:
    return conv(x, w, bias, ids)
  seq = P(None, AXIS)
  sharded = jax.shard_map(
      conv, mesh=common.mesh(num_ranks), in_specs=(seq, P(), P(), seq),
      out_specs=seq)
  return sharded(x, w, bias, ids)


def outputs_and_grads(x, w, bias, ids, num_ranks, activation):
  dy = jnp.asarray(np.random.default_rng(3).normal(size=x.shape),
                   jnp.float32)

  def loss(x, w, bias):
    y = run_conv(x, w, bias, ids, num_ranks, activation)
    return jnp.sum(y * dy), y

  (gx, gw, gb), y = jax.jit(jax.grad(loss, argnums=(0, 1, 2),
                                     has_aux=True))(x, w, bias)
  return y, dict(x=gx, w=gw, bias=gb)


class ContextParallelConvTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("cp2_w4_segments", 2, 4, common.T, True, "silu"),
      ("cp4_w4_segments", 4, 4, common.T, True, "silu"),
      ("cp8_w4_no_segments", 8, 4, common.T, False, None),
      ("cp8_w4_segments", 8, 4, common.T, True, "silu"),
      # W - 1 = 7 > 2 * (16 / 8): the halo spans more than three ranks.
      ("cp8_halo_spans_ranks", 8, 8, 16, True, "silu"),
      ("cp4_halo_spans_ranks_no_segments", 4, 8, 8, False, "silu"),
      ("cp2_w1", 2, 1, 16, True, "silu"),
  )
  def test_matches_single_device(self, num_ranks, width, t, segmented,
                                 activation):
    rng = np.random.default_rng(width + t)
    c = 6
    x = jnp.asarray(rng.normal(size=(2, t, c)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(width, c)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(c,)), jnp.float32)
    ids = None
    if segmented:
      ids = jnp.asarray(common.packed_segment_ids() if t == common.T
                        else SHORT_IDS[:, :t])
    y, grads = outputs_and_grads(x, w, bias, ids, num_ranks, activation)
    y_ref, grads_ref = outputs_and_grads(x, w, bias, ids, None, activation)
    testing.assert_close(y, y_ref, rtol=1e-5, name="output")
    testing.assert_close(y, conv_numpy(x, w, ids, activation, bias),
                         rtol=1e-5, name="output vs NumPy")
    for name in grads_ref:
      testing.assert_close(grads[name], grads_ref[name], rtol=1e-5,
                           name=f"d{name}")

  def test_cache_and_bad_axis_rejected(self):
    x = jnp.ones((1, 8, 2))
    w = jnp.ones((4, 2))
    with self.assertRaisesRegex(NotImplementedError, "cache"):
      ops.short_conv1d(x, w, cache=jnp.zeros((1, 3, 2)), context_axis=AXIS)
    with self.assertRaisesRegex(ValueError, "not a bound mesh axis"):
      ops.short_conv1d(x, w, context_axis=AXIS)
    with self.assertRaisesRegex(ValueError, "context_axis must be None or"):
      ops.short_conv1d(x, w, context_axis=0)
