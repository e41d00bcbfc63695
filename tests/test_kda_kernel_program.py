"""`benchmarks/kda_kernel_program.py`: its counts on hand-made programs.

The row-pass model against products worked out by hand, and the counts of
a small Pallas kernel whose casts and products are known, so that the
kernels' own counts (`tests/ops/test_kda_pallas_batched.py`, the results
in benchmarks/results) rest on a counter that sees a repeat when there is
one.
"""

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import pytest

from benchmarks import kda_kernel_program as program

NN = (((2,), (1,)), ((0,), (0,)))
NT = (((2,), (2,)), ((0,), (0,)))
PLAIN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("lhs, rhs, dims, float32, passes", [
    ((16, 64, 64), (16, 64, 256), NN, False, 16 * 64 * 1 * 2),
    ((16, 32, 128), (16, 64, 128), NT, False, 16 * 32 * 1 * 1),
    ((16, 128, 64), (16, 64, 128), NN, False, 16 * 128 * 1 * 1),
    ((192, 64), (64, 2048), PLAIN, False, 192 * 1 * 16),
    ((64, 192), (192, 2048), PLAIN, False, 64 * 2 * 16),
    ((16, 64, 64), (16, 64, 64), NN, True, 16 * 64 * 6),
])
def test_row_passes_of_products_worked_by_hand(lhs, rhs, dims, float32,
                                               passes):
  # Rows of the left operand, times the right operand's 128 x 128 tiles
  # (contraction tiles times output-column tiles), per batch entry.
  assert program.row_passes(lhs, rhs, dims, float32) == passes


def test_counts_of_a_kernel_with_a_known_repeat():
  # x is cast to bfloat16 twice (a repeat of 64 x 128 elements) for one
  # product, y once; one [64, 128] x [128, 128] product: 64 row passes.
  def kernel(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    a = jnp.dot(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16),
                preferred_element_type=jnp.float32)
    o_ref[...] = a + x.astype(jnp.bfloat16).astype(jnp.float32)[:, :128]

  def call(x, y):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32),
        interpret=True)(x, y)

  x = jnp.ones((64, 128), jnp.float32)
  y = jnp.ones((128, 128), jnp.float32)
  (kernel_jaxpr,) = program.kernel_jaxprs(jax.make_jaxpr(call)(x, y).jaxpr)
  counts = program.count(kernel_jaxpr)
  assert counts["products"]["count"] == 1
  assert counts["products"]["bf16"] == 1
  assert counts["products"]["row_passes"] == 64
  assert counts["products"]["macs"] == 64 * 128 * 128
  assert counts["bf16_casts"] == 3
  assert counts["repeated_bf16_casts"] == 1
  assert counts["repeated_bf16_cast_elements"] == 64 * 128
