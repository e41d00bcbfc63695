"""Matmul precision: one setting per module, resolved from the inputs' dtype.

On a CPU every float32 matmul is exact float32 whatever the precision says.
On a TPU (and on a GPU with TF32) JAX's default precision runs a float32
matmul as one bfloat16 pass (8 bits of mantissa): three digits. So every
module of the library (the KDA op and layer, softmax attention, the CSA
indexer op and module, the experiments' model) takes a `precision` name and
pins it on every matmul it runs, whatever `jax.default_matmul_precision`
says:

* "auto" (every default): HIGHEST for float32 / float64 inputs, DEFAULT (one
  bfloat16 pass) for bfloat16 / float16 inputs, whose own rounding (~4e-3)
  is already larger than a one-pass matmul's;
* "highest", "high", "default": that `jax.lax.Precision` (on TPU: HIGHEST is
  six bfloat16 passes, HIGH three, DEFAULT one).

The KDA op refines the names into a group per kind of product
(`linear_attention/ops/kda/precision.py`); everything else runs one
precision on all its matmuls.
"""

import jax
import jax.numpy as jnp

from linear_attention.ops import checks

Precision = jax.lax.Precision

NAMES = ("auto", "highest", "high", "default")
_LOW_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16)))


def validate(name) -> None:
  """ValueError naming `precision` unless `name` is one of `NAMES`."""
  checks.one_of("precision", name, NAMES)


def for_dtype(name: str, dtype) -> Precision:
  """The `lax.Precision` the name `name` gives a matmul on `dtype` inputs."""
  validate(name)
  if name == "auto":
    return (Precision.DEFAULT if jnp.dtype(dtype) in _LOW_DTYPES
            else Precision.HIGHEST)
  return Precision[name.upper()]
