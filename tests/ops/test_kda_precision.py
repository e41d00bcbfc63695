"""The op pins its matmul precision, whatever the process default says.

A CPU computes float32 products exactly at any precision, so these tests read
the precision every matmul is lowered with for a TPU (`tests/lowered.py`),
forward and backward, instead of comparing numbers;
the numbers at the default precision are checked against float64 on whatever
device runs the suite by tests/ops/test_kda_device_accuracy.py (on a TPU with
`make test-tpu`).
"""

import collections

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp

from linear_attention import ops
from linear_attention.modules import KimiDeltaAttention
from linear_attention.ops.kda import precision as precision_lib
from tests import lowered

P = jax.lax.Precision
B, T, H, K = 1, 40, 2, 8


def _inputs(dtype):
  q, k, v, g = (jax.random.normal(jax.random.key(i), (B, T, H, K), dtype)
                for i in range(4))
  return q, k, v, g, jnp.full((B, T, H), 0.5, dtype)


def _dot_precisions(fn, *args):
  """Counter of (lhs, rhs) precision names over the lowered module's
  matmuls."""
  return collections.Counter(m.precision for m in lowered.matmuls(fn, *args))


def _grad_of_op(precision, backend, segments=False, dtype=jnp.float32):
  """d/d(q, k, v, g, beta) of a loss of the op's output and final state."""
  def loss(q, k, v, g, beta):
    ids = (jnp.where(jnp.arange(T) < 25, 1, 2)[None] if segments else None)
    o, s = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=jnp.zeros(H), dt_bias=jnp.zeros(H * K),
        use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm=True,
        output_final_state=True, segment_ids=ids,
        max_num_segments=2 if segments else None, backend=backend,
        precision=precision)
    return (jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2))
  return jax.grad(loss, argnums=tuple(range(5)))


class PrecisionTest(parameterized.TestCase):

  @parameterized.product(backend=("reference", "chunked"),
                         segments=(False, True))
  def test_float32_auto_is_highest_under_a_low_process_default(
      self, backend, segments):
    with jax.default_matmul_precision("bfloat16"):
      found = _dot_precisions(_grad_of_op("auto", backend, segments),
                              *_inputs(jnp.float32))
    self.assertNotEmpty(found)
    self.assertEqual(set(found), {("HIGHEST", "HIGHEST")}, found)

  @parameterized.parameters("reference", "chunked")
  def test_bfloat16_auto_is_one_pass_under_a_high_process_default(
      self, backend):
    with jax.default_matmul_precision("highest"):
      found = _dot_precisions(_grad_of_op("auto", backend, dtype=jnp.bfloat16),
                              *_inputs(jnp.bfloat16))
    # Only the decay exponents' 0/1 range sums stay HIGHEST (chunked).
    self.assertGreater(found[("DEFAULT", "DEFAULT")], 0, found)
    self.assertEqual(set(found) - {("DEFAULT", "DEFAULT"),
                                   ("HIGHEST", "HIGHEST")}, set(), found)
    if backend == "reference":
      self.assertEqual(set(found), {("DEFAULT", "DEFAULT")}, found)

  def test_each_group_takes_its_own_precision(self):
    chosen = precision_lib.Precisions(
        scores=P.HIGH, solve=P.DEFAULT, state=P.DEFAULT, output=P.DEFAULT)
    found = _dot_precisions(_grad_of_op(chosen, "chunked"),
                            *_inputs(jnp.float32))
    self.assertGreater(found[("HIGH", "HIGH")], 0, found)
    self.assertGreater(found[("DEFAULT", "DEFAULT")], 0, found)
    self.assertEqual(set(found), {("HIGH", "HIGH"), ("DEFAULT", "DEFAULT"),
                                  ("HIGHEST", "HIGHEST")}, found)

  def test_resolve(self):
    self.assertEqual(precision_lib.resolve("auto", jnp.float32),
                     precision_lib.ACCURATE)
    self.assertEqual(precision_lib.resolve("auto", jnp.bfloat16),
                     precision_lib.FAST)
    self.assertEqual(precision_lib.resolve("high", jnp.bfloat16),
                     precision_lib.Precisions(P.HIGH, P.HIGH, P.HIGH, P.HIGH))

  def test_bad_precision_raises_value_error_naming_it(self):
    q, k, v, g, beta = _inputs(jnp.float32)
    for bad in ("fast", None, 3, precision_lib.Precisions(1, 2, 3, 4)):
      with self.assertRaisesRegex(ValueError, "precision"):
        ops.kimi_delta_attention(q, k, v, g, beta, precision=bad)
    with self.assertRaisesRegex(ValueError, "precision"):
      hk.transform(lambda: KimiDeltaAttention(
          num_heads=2, head_dim=8, precision="fast")).init(None)

  def test_mosaic_takes_only_auto(self):
    q, k, v, g, beta = _inputs(jnp.float32)
    g = -jnp.abs(g)  # a valid log decay: the refusal must be the backend's
    with self.assertRaisesRegex(NotImplementedError, "precision"):
      ops.kimi_delta_attention(q, k, v, g, beta, backend="mosaic",
                               precision="highest")

  @parameterized.parameters(("auto", "HIGHEST"), ("default", "DEFAULT"))
  def test_layer_pins_its_projections_too(self, name, want):
    f = hk.transform(lambda x: KimiDeltaAttention(
        num_heads=2, head_dim=8, lower_bound=-5.0, precision=name)(x)[0])
    x = jax.random.normal(jax.random.key(0), (1, T, 16))
    params = f.init(jax.random.key(1), x)
    with jax.default_matmul_precision("bfloat16" if want == "HIGHEST"
                                      else "highest"):
      found = _dot_precisions(
          jax.grad(lambda p, x: jnp.sum(f.apply(p, None, x) ** 2)), params, x)
    self.assertGreater(found[(want, want)], 0, found)
    self.assertEqual(set(found) - {("HIGHEST", "HIGHEST")} - {(want, want)},
                     set(), found)


if __name__ == "__main__":
  absltest.main()
