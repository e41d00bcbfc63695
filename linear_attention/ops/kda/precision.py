"""The KDA op's matmul precision: owned by the op, not the process default.

On a CPU every float32 matmul is exact float32 whatever the precision says
(except backend `pallas`'s HIGH, written out as three bfloat16 products so
that interpret mode has the chip's rounding: `pallas_batched._dot`).
On a TPU (and on a GPU with TF32) JAX's default precision runs a float32
matmul as one bfloat16 pass (8 bits of mantissa), and the chunked form's
output then differs from the float64 recurrence by ~4e-3 (relative L2; the
gate's gradient by ~3e-2): three digits. So the op pins the precision of
every matmul it runs, by group, from its `precision` argument:

* a name of `linear_attention.ops.precision` (the rule every module
  follows): "auto" (the op's default) is `ACCURATE` for float32 / float64
  inputs and `FAST` for bfloat16 / float16 inputs (backend `pallas` runs
  float32 at "auto" at HIGH: within the op's float32 bounds at fewer
  passes, `pallas.FLOAT32_AUTO`); "highest", "high", "default" are that
  `jax.lax.Precision` on every group;
* a `Precisions` tuple: each group by hand (for tuning and benchmarks).

The groups, by what a rounding error in them does:

* `scores`: the chunk's key-key and query-key products A_kk, A_qk;
* `solve`: the UT transform's unit-triangular solve (the inverse of the
  diagonal blocks and the substitution), whose errors the inverse amplifies;
* `state`: everything that reads or writes the carried state (W X, Q X, the
  update K_end^T V_new, affine chunk maps; every product of the `reference`
  token scan): their errors are carried to every later token;
* `output`: the intra-chunk output A_qk V_new.

The decay exponents' range sums (0/1 matrices) are always HIGHEST: an error
in a sum of 64 log decays of up to -5 each is an error in an exponent. So
are the context-parallel merges of rank states (one K x K product a rank).
The `mosaic` backend runs tokamax's kernel, which pins its own precision.
`ACCURATE` is HIGHEST on every group: measured on a TPU v5e against the
float64 recurrence, see docs/tpu.md for its accuracy and what it costs.
"""

from typing import NamedTuple

import jax

from linear_attention.ops import precision as shared

Precision = jax.lax.Precision


class Precisions(NamedTuple):
  """The precision of each group of the op's matmuls (see the module)."""

  scores: Precision
  solve: Precision
  state: Precision
  output: Precision

  @classmethod
  def every(cls, p: Precision) -> "Precisions":
    return cls(p, p, p, p)


ACCURATE = Precisions.every(Precision.HIGHEST)
FAST = Precisions.every(Precision.DEFAULT)
NAMES = shared.NAMES


def validate(precision) -> None:
  """ValueError unless `precision` is one of `NAMES` or a `Precisions`."""
  if isinstance(precision, Precisions):
    if not all(isinstance(p, Precision) for p in precision):
      raise ValueError("precision: every field of a Precisions must be a"
                       f" jax.lax.Precision; got {precision!r}.")
    return
  if not isinstance(precision, str) or precision not in NAMES:
    raise ValueError(f"precision must be one of {NAMES} or a Precisions;"
                     f" got {precision!r}.")


def resolve(precision, dtype) -> Precisions:
  """The `Precisions` an op call runs with, for inputs of `dtype`.

  Args:
    precision: one of `NAMES`, or a `Precisions` (returned as it is).
    dtype: the dtype of the op's inputs (q's).
  """
  validate(precision)
  if isinstance(precision, Precisions):
    return precision
  return Precisions.every(shared.for_dtype(precision, dtype))
