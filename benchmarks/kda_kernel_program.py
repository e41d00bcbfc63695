r"""What the batched kernels' programs hold per grid step (any host).

    python -m benchmarks.kda_kernel_program --out=DIR

Reads the kernel bodies that `pallas_batched.kda` hands to Mosaic (the
jaxprs inside its `pallas_call`s, traced on this host in interpret mode: the
same program a TPU compiles) and counts, per kernel and grid step: the
products (`dot_general`s, their multiply-adds and operand dtypes), the
casts to bfloat16 (a HIGH product's operands are split into bfloat16 heads
and tails; a DEFAULT product's are cast) and how many of them repeat the
cast of a value already cast (the same input cast twice: work the kernel
could skip), and the other operations by the elements they write.

Each product also gets a model count of matrix-unit row passes: a TPU's
128 x 128 unit takes the right-hand operand as [128, 128] tiles and streams
the left-hand rows through each, so a product [M, K] x [K, N] costs about M
ceil(K / 128) ceil(N / 128) row passes (times its batch; a float32 product,
HIGHEST, six bfloat16 ones), however few of the 128 x 128 multipliers a
small K or N fills. A count is not a time: the chip decides
(`kda_tpu_session.py`); this shows what a change did to the program.

Configurations: bfloat16 inputs at one pass (DEFAULT) and float32 inputs at
HIGH (the backend's float32 "auto"), both raw with the fused lower-bound
gate and the q/k L2 norm, 16 heads a step (`heads_per_block=16`), K = V =
128, chunk 64; forward and fused backward kernels. Writes
DIR/kda_kernel_program.json (JAX version, commit, rows).
"""

import argparse
import collections
import json
import os

import jax
from jax.extend import core as jcore
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_error_vs_length
from experiments.tools import cli
from linear_attention.ops.kda import pallas_batched
from linear_attention.ops.kda import precision as precision_lib

# Operations that move or view data rather than compute on it.
MOVES = frozenset({
    "broadcast_in_dim", "concatenate", "reshape", "slice", "squeeze",
    "transpose", "iota", "expand_dims", "get", "swap", "load", "store",
    "masked_load", "masked_store", "dynamic_slice", "dynamic_update_slice",
    "program_id", "num_programs", "pjit", "closed_call", "cond", "while",
    "scan", "run_scoped",
})


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for x in value if isinstance(value, (list, tuple)) else [value]:
      if isinstance(x, jcore.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jcore.Jaxpr):
        yield x


def kernel_jaxprs(jaxpr):
  """The kernel bodies of every `pallas_call` in `jaxpr`, in order."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.append(eqn.params["jaxpr"])
    else:
      for sub in _sub_jaxprs(eqn):
        out.extend(kernel_jaxprs(sub))
  return out


def _elements(aval):
  return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 0


def row_passes(lhs, rhs, dims, float32=False):
  """The model's matrix-unit row passes of one `dot_general` (see above)."""
  (lc, rc), (lb, rb) = dims
  size = lambda shape, axes: int(np.prod([shape[d] for d in axes]))
  batch = size(lhs, lb)
  m = size(lhs, [d for d in range(len(lhs)) if d not in lc + lb])
  n = size(rhs, [d for d in range(len(rhs)) if d not in rc + rb])
  k = size(lhs, lc)
  tiles = lambda x: -(-x // 128)
  return batch * m * tiles(k) * tiles(n) * (6 if float32 else 1)


def count(kernel):
  """A kernel body's counts (one grid step; branches counted as taken)."""
  casts = collections.Counter()  # input var -> casts to bfloat16
  sizes = {}
  products = dict(count=0, macs=0, bf16=0, f32=0, row_passes=0)
  shapes = collections.Counter()  # (lhs, rhs, dims) -> products
  other = collections.Counter()  # primitive -> elements written
  moves = 0

  def walk(jaxpr):
    nonlocal moves
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      subs = list(_sub_jaxprs(eqn))
      for sub in subs:
        walk(sub)
      if subs or name in MOVES:
        moves += sum(_elements(v.aval) for v in eqn.outvars)
        continue
      if name == "dot_general":
        dims = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
        products["count"] += 1
        products["macs"] += _elements(eqn.outvars[0].aval) * int(
            np.prod([lhs.shape[d] for d in dims[0][0]]))
        key = "bf16" if lhs.dtype == jnp.bfloat16 else "f32"
        products[key] += 1
        products["row_passes"] += row_passes(lhs.shape, rhs.shape, dims,
                                             key == "f32")
        shapes[(tuple(lhs.shape), tuple(rhs.shape), dims, key)] += 1
        continue
      if (name == "convert_element_type"
          and eqn.params["new_dtype"] == jnp.bfloat16
          and isinstance(eqn.invars[0], jcore.Var)):
        casts[eqn.invars[0]] += 1
        sizes[eqn.invars[0]] = _elements(eqn.invars[0].aval)
      other[name] += sum(_elements(v.aval) for v in eqn.outvars)

  walk(kernel)
  repeated = {v: n - 1 for v, n in casts.items() if n > 1}
  return dict(
      products=products,
      bf16_casts=sum(casts.values()),
      bf16_cast_elements=sum(n * sizes[v] for v, n in casts.items()),
      repeated_bf16_casts=sum(repeated.values()),
      repeated_bf16_cast_elements=sum(n * sizes[v]
                                      for v, n in repeated.items()),
      elementwise_elements=sum(other.values()),
      moved_elements=moves,
      elementwise_by_op=dict(other.most_common()),
      products_by_shape=[
          dict(lhs=list(l), rhs=list(r), dims=str(d), operands=key, count=n,
               row_passes=n * row_passes(l, r, d, key == "f32"))
          for (l, r, d, key), n in shapes.most_common()])


CONFIGS = {
    "bfloat16_default": (jnp.bfloat16, jax.lax.Precision.DEFAULT),
    "float32_high": (jnp.float32, jax.lax.Precision.HIGH),
}


def programs(name, *, heads=16, seq=256, dim=128, strided=False):
  """{"forward": counts, "backward": counts} for one of `CONFIGS`."""
  dtype, prec = CONFIGS[name]
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  shape = (1, seq, heads, dim)
  q, k, v, g = (jax.random.normal(kk, shape, dtype) for kk in keys[:4])
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], shape[:3], dtype))
  a_log = jnp.zeros((heads,), jnp.float32)
  dt_bias = jnp.zeros((heads * dim,), jnp.float32)

  def forward(q, k, v, g, beta):
    o, final = pallas_batched.kda(
        q, k, v, g, beta, scale=dim ** -0.5, a_log=a_log, dt_bias=dt_bias,
        lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
        precision=precision_lib.Precisions.every(prec),
        heads_per_block=heads, strided=strided, interpret=True)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

  args = (q, k, v, g, beta)
  grad = jax.grad(forward, argnums=tuple(range(5)))
  kernels = kernel_jaxprs(jax.make_jaxpr(grad)(*args).jaxpr)
  if len(kernels) != 2:
    raise RuntimeError(f"expected a forward and a backward kernel; found"
                       f" {len(kernels)}")
  return dict(forward=count(kernels[0]), backward=count(kernels[1]))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="kda_kernel_program",
                 type=cli.output_folder)
  a = p.parse_args()
  commit, dirty = kda_error_vs_length.git_commit()
  rows = []
  for name in CONFIGS:
    for strided in (False, True):
      for kernel, c in programs(name, strided=strided).items():
        rows.append(dict(config=name, strided=strided, kernel=kernel, **c))
  report = dict(jax=jax.__version__, commit=commit, dirty=dirty,
                shape="B1 H16 K128 V128, chunk 64, 16 heads a step",
                rows=rows)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "kda_kernel_program.json"), "w") as fh:
    json.dump(report, fh, indent=1)
  for r in rows:
    pr = r["products"]
    print(f"{r['config']:>17} {'strided' if r['strided'] else 'blocks':>7}"
          f" {r['kernel']:>8}: {pr['count']} products"
          f" ({pr['macs'] / 1e6:.1f} M MACs, {pr['row_passes']} row passes),"
          f" bf16 casts"
          f" {r['bf16_cast_elements'] / 1e6:.2f} M elements"
          f" ({r['repeated_bf16_cast_elements'] / 1e6:.2f} M repeated),"
          f" other ops {r['elementwise_elements'] / 1e6:.2f} M elements")


if __name__ == "__main__":
  cli.run_script(main)
