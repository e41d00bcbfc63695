"""Haiku's linear layer with its matmul precision pinned.

`hk.Linear` multiplies at `jax.default_matmul_precision` unless told
otherwise: one bfloat16 pass for float32 on a TPU. Every projection of the
library's modules goes through `linear`, which pins the module's
`precision` name for the input's dtype (`linear_attention.ops.precision`).
"""

import haiku as hk
import jax

from linear_attention.ops import precision as precision_lib


def linear(x: jax.Array, size: int, *, precision: str, name: str,
           w_init=None, with_bias: bool = False) -> jax.Array:
  """x W (+ b) as `hk.Linear(size, ...)`, at `precision` for x's dtype."""
  layer = hk.Linear(size, with_bias=with_bias, w_init=w_init, name=name)
  return layer(x, precision=precision_lib.for_dtype(precision, x.dtype))
