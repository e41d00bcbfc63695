"""The matmuls of a lowered program and the precision each one is pinned at.

A CPU computes float32 products exactly at any precision, so precision
tests read the StableHLO text instead of comparing numbers: every
`stablehlo.dot_general` (`precision = [LHS, RHS]`) and
`stablehlo.convolution` (`precision_config = [...]`), with its operands'
element types. A matmul lowered without a precision of its own takes
`jax.default_matmul_precision`'s, so `pinned` lowers twice under two
opposite process defaults: a matmul whose precision moves is not pinned.

The program is lowered for a TPU on any host (`lowering_platforms`), the
text a TPU compiles. The CPU's lowering converts both operands of a mixed
(float32, bfloat16) dot_general to float32 before it, so there a float32
activation meeting a bfloat16 weight read as a float32 dot at HIGHEST,
which "auto" allows; the TPU's keeps the bfloat16 operand, which "auto"
wants at DEFAULT. (That is how a bfloat16 model whose RoPE returned
float32 ran its attention's products, its `out` projection and the MLP
and unembedding after it at HIGHEST on a TPU, unseen on CPU.) Every
caller's program lowers for the TPU off a TPU, the CSA Pallas kernels in
interpret mode included (interpret mode lowers to ordinary ops).
"""

import re
from typing import NamedTuple

import jax

_DOT = re.compile(r"precision = \[(\w+), (\w+)\]")
_CONV = re.compile(r"precision_config = \[#stablehlo<precision (\w+)>,"
                   r" #stablehlo<precision (\w+)>\]")
_OPERANDS = re.compile(r" : \(tensor<(?:[0-9?]+x)*(\w+)>,"
                       r" tensor<(?:[0-9?]+x)*(\w+)>\)")


class Matmul(NamedTuple):
  op: str  # "dot_general" or "convolution"
  precision: tuple[str, str]  # (lhs, rhs); ("NONE", "NONE"): no attribute
  dtypes: tuple[str, str]  # the operands' element types, e.g. ("bf16", "f32")


def matmuls(fn, *args) -> list[Matmul]:
  """Every dot_general and convolution of `fn` on `args` lowered for a TPU
  (module docstring), in the order of the module's text."""
  found = []
  traced = jax.jit(fn).trace(*args)
  text = traced.lower(lowering_platforms=("tpu",)).as_text()
  for line in text.splitlines():
    for op, pattern in (("dot_general", _DOT), ("convolution", _CONV)):
      if f"stablehlo.{op}" not in line:
        continue
      if "algorithm = " in line:  # pinned by a dot algorithm instead
        precision = ("ALGORITHM", "ALGORITHM")
      else:
        m = pattern.search(line)
        precision = (m.group(1), m.group(2)) if m else ("NONE", "NONE")
      operands = _OPERANDS.search(line)
      found.append(Matmul(op, precision, operands.groups()))
  return found


def pinned(fn, *args) -> list[Matmul]:
  """`matmuls(fn, *args)`, checked to be the same under the process
  defaults "bfloat16" (one pass) and "highest": AssertionError naming every
  matmul whose precision follows the process default instead."""
  with jax.default_matmul_precision("bfloat16"):
    low = matmuls(fn, *args)
  with jax.default_matmul_precision("highest"):
    high = matmuls(fn, *args)
  assert len(low) == len(high), (len(low), len(high))
  moved = [(i, a.op, a.dtypes, a.precision, b.precision)
           for i, (a, b) in enumerate(zip(low, high)) if a != b]
  assert not moved, (
      "matmuls that take the process default (index, op, operand types,"
      f" precision under 'bfloat16', under 'highest'): {moved}")
  return low
