r"""Where our Pallas KDA forward kernel spends its time, piece by piece.

    python -m benchmarks.kda_tpu_parts --out=DIR     # on a TPU host

A profile names the kernel's total time only (one `tpu_custom_call`), so
this script times kernels that run *parts* of the forward kernel's body
(`pallas_tpu._kernel`) on its grid, blocks and inputs: the same
(B*H/hb, T/C) grid, the same [C, hb*K] blocks, the same per-head loop, and
an output that depends on every part computed (so nothing is dropped). Each
variant is a set of parts:

* `exponents`: how the exponent factors are made. `E_highest` is the
  kernel's own (the constant matrix E [(3 + C/16) C + 8, C] times g at
  HIGHEST); `E_split3` the same sums from three bfloat16 pieces of g at one
  pass each (exact: E is exact in bfloat16); `cumsum` one [C, C] lower
  triangle times g in three bfloat16 pieces, the factors then formed on the
  vector unit (as many exponentials as the kernel takes);
* `scores`: A_qk and A_kk by 16-token row blocks (`_block_scores`), masked;
* `solve`: `blocks` is the kernel's (16 x 16 diagonal inverses by squaring,
  then block substitution); `square64` inverts the whole 64 x 64 unit
  lower-triangular matrix by six squarings and multiplies once;
* `batched_hb<n>`: the batched-heads forward (`pallas_batched.kda_forward`)
  with n heads a grid step, whole;
* `state`: the chunk-to-chunk part (V_new = U - W X, O = (Q exp G) X +
  A_qk V_new, X' = exp(G_C) X + (K exp(G_C - G))^T V_new), with W = k and
  U = v when the solve is not run.

The batched kernel (`pallas_batched.py`, the `pallas` backend's, on raw
inputs with the fused gate and the q/k L2 norm) is timed the same way by
stages of its forward body, each variant running every stage up to its
own (`BATCHED_STAGES`): `b_io` (read the blocks, write the output),
`b_prep` (+ the L2 norm, scale and gate), `b_factors` (+ the exponent
factors), `b_scores` (+ the masked scores), `b_ut` (+ the UT transform's
solve), `b_state` (+ the chunk-to-chunk state: the whole body), and
`b_kernel` (the kernel itself through `pallas_batched.kda`), with
`--batched_heads` heads a step (16: the backend's for bfloat16).

Matmuls run at the op's "auto" precision for the input dtype (one bfloat16 pass
for bfloat16), as `pallas_tpu.kda_forward` does; the `b_*` variants at the
`pallas` backend's (HIGH on every group for float32). Times are medians of
`--repeats` calls after a warm call (the kernel is the whole program but for
the input reshapes, which every variant shares); `full` is the kernel itself.
Writes `DIR/kda_tpu_parts.json` after each variant.
"""

import argparse
import functools
import json
import os
import statistics
import time
import traceback

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_tpu
from experiments.tools import cli
from linear_attention.ops import backends
from linear_attention.ops.kda import pallas as pallas_backend
from linear_attention.ops.kda import pallas_batched
from linear_attention.ops.kda import pallas_tpu as pt
from linear_attention.ops.kda import precision as precision_lib

F32 = jnp.float32
BF16 = jnp.bfloat16

# name: (exponents, scores, solve, state)
VARIANTS = {
    "io": ("none", False, "none", False),
    "exp_E_highest": ("E_highest", False, "none", False),
    "exp_E_split3": ("E_split3", False, "none", False),
    "exp_cumsum": ("cumsum", False, "none", False),
    "exp+scores": ("E_highest", True, "none", False),
    "exp+scores+solve_blocks": ("E_highest", True, "blocks", False),
    "exp+scores+solve_square64": ("E_highest", True, "square64", False),
    "state_only": ("none", False, "none", True),
    "all_parts": ("E_highest", True, "blocks", True),
    "full": None,
    "batched_hb4": 4,
    "batched_hb8": 8,
    "batched_hb16": 16,
}
BATCHED_STAGES = ("b_io", "b_prep", "b_factors", "b_scores", "b_ut",
                  "b_state")
BATCHED_VARIANTS = BATCHED_STAGES + ("b_kernel",)


def _split3(x):
  """x = a + b + c with a, b, c bfloat16 (exact for float32 x)."""
  a = x.astype(BF16)
  r = x - a.astype(F32)
  b = r.astype(BF16)
  c = (r - b.astype(F32)).astype(BF16)
  return a, b, c


def _dot1(a, b, dims):
  return jax.lax.dot_general(a.astype(BF16), b.astype(BF16), dims,
                             preferred_element_type=F32)


def _exponents(kind, g, emat, tril, t, m):
  """(read, to_end, rowf, total [1, K], colfs) as the kernel uses them."""
  c, nb = t.chunk, t.blocks
  if kind == "E_highest":
    x = jax.lax.dot_general(emat, g, pt._NN, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=F32)
  elif kind == "E_split3":
    e16 = emat.astype(BF16)
    x = sum(_dot1(e16, piece, pt._NN) for piece in _split3(g))
  else:  # cumsum: G by one triangle, the rest on the vector unit
    big = sum(_dot1(tril, piece, pt._NN) for piece in _split3(g))
    tot = big[c - 1:c]
    half = 0.5 * tot
    x = jnp.concatenate([big, tot - big, big - half]
                        + [half - big] * nb + [jnp.broadcast_to(tot, (8, big.shape[1]))],
                        axis=0)
  read = jnp.exp(x[0:c])
  to_end = jnp.exp(x[c:2 * c])
  rowf = jnp.exp(x[2 * c:3 * c])
  total = jnp.exp(x[(3 + nb) * c:(3 + nb) * c + 1])
  colfs = [jnp.where(m.token < pt.SUB * (n + 1),
                     jnp.exp(x[(3 + n) * c:(4 + n) * c]), 0.0)
           for n in range(nb)]
  return read, to_end, rowf, total, colfs


def _square64(a, eye):
  """(I + A)^-1 for A [C, C] strictly lower: six squarings (A^64 = 0)."""
  inv, power = eye - a, a
  for _ in range(5):
    power = _dot1(power, power, pt._NN)
    inv = _dot1(inv, eye + power, pt._NN)
  return inv


def _parts_kernel(e_ref, tril_ref, q_ref, k_ref, v_ref, g_ref, b_ref, o_ref,
                  sf_ref, state_ref, x_ref, *, t, parts):
  exponents, scores, solve, with_state = parts
  kd, vd, c = t.key_dim, t.value_dim, t.chunk
  chunk_id = pl.program_id(1)

  @pl.when(chunk_id == 0)
  def _():
    state_ref[...] = jnp.zeros(state_ref.shape, F32)

  m = pt._Consts(c, kd)
  emat, tril = e_ref[...], tril_ref[...]
  for h in range(t.heads_per_block):
    q, k, v, g, beta = pt._head_inputs(h, t, m, q_ref, k_ref, v_ref, g_ref,
                                       b_ref)
    acc = q
    read = to_end = jnp.ones_like(q)
    total = jnp.ones((1, kd), F32)
    a_qk = jnp.where(m.causal, 1.0, 0.0)
    w, u = k, v
    if exponents != "none":
      read, to_end, rowf, total, colfs = _exponents(exponents, g, emat, tril,
                                                    t, m)
      acc = acc * read + to_end + rowf + sum(colfs)
      if scores:
        qk_rows, kk_rows = pt._block_scores(q * rowf, k * rowf, k, colfs,
                                            nb=t.blocks,
                                            precision=t.precision.scores)
        a_qk = jnp.where(m.causal, jnp.concatenate(qk_rows, axis=0), 0.0)
        s = jnp.where(m.below, jnp.concatenate(kk_rows, axis=0), 0.0)
        acc = acc + jnp.sum(a_qk, axis=1, keepdims=True)
        if solve != "none":
          rhs = jnp.concatenate([read * k, v], axis=1) * beta
          if solve == "blocks":
            wu = pt._unit_lower_solve(s * beta, rhs, x_ref, m.same_block,
                                      m.eye, nb=t.blocks,
                                      precision=t.precision.solve)
          else:
            wu = _dot1(_square64(s * beta, m.eye), rhs, pt._NN)
          w, u = wu[:, :kd], wu[:, kd:]
          acc = acc + w
    if with_state:
      state = state_ref[h]
      v_new = u - _dot1(w, state, pt._NN)
      o = _dot1(q * read, state, pt._NN) + _dot1(a_qk, v_new, pt._NN)
      decay = pt._column(total, m.eye_k)
      state_ref[h] = decay * state + _dot1(k * to_end, v_new, pt._TN)
      acc = acc + o
    o_ref[:, h * vd:(h + 1) * vd] = acc[:, :vd].astype(o_ref.dtype)

  @pl.when(chunk_id == pl.num_programs(1) - 1)
  def _():
    sf_ref[...] = state_ref[...]


def parts_fn(parts, heads_per_block=4):
  """f(q, k, v, g, beta) -> (o, state) running `parts` of the kernel body."""
  def f(q, k, v, g, beta):
    b, seq, h, kd = q.shape
    vd = v.shape[-1]
    t = pt.Tiles(chunk=64, heads_per_block=heads_per_block, key_dim=kd,
                 value_dim=vd, has_initial_state=False,
                 precision=precision_lib.resolve("auto", q.dtype),
                 interpret=backends.target_platform() != "tpu")
    c, hb = t.chunk, t.heads_per_block
    nh = h // hb
    n, _, spec = pt._layout(t, b, seq, h)
    flat = lambda x: x.reshape(b, seq, h * x.shape[-1])
    tok = spec["tok"]
    tril = np.tril(np.ones((c, c), np.float32)).astype(jnp.bfloat16)
    in_specs = [spec["emat"], pl.BlockSpec((c, c), lambda i, j: (0, 0)),
                tok(kd), tok(kd), tok(vd), tok(kd), spec["rows"]]
    out = pl.pallas_call(
        functools.partial(_parts_kernel, t=t, parts=parts),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(b * nh, n), in_specs=in_specs,
            out_specs=[tok(vd), spec["state"]],
            scratch_shapes=[pltpu.VMEM((hb, kd, vd), F32),
                            pltpu.VMEM((c, kd + vd), F32)]),
        out_shape=[jax.ShapeDtypeStruct((b, seq, h * vd), q.dtype),
                   jax.ShapeDtypeStruct((b * h, kd, vd), F32)],
        compiler_params=pt._params(pt.vmem_bytes(t, q.dtype, g.dtype)),
        interpret=t.interpret,
    )(jnp.asarray(pt.exponent_matrix(c)), jnp.asarray(tril), flat(q),
      flat(k), flat(v), flat(g), pt._beta_rows(beta, n, c, nh, hb))
    return out[0].reshape(b, seq, h, vd), out[1]
  return f


def _batched_parts_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, rate_ref,
                          dtb_ref, o_ref, sf_ref, state_ref, *, t, stage):
  """`pallas_batched._kernel`'s body up to `stage` (an index into
  BATCHED_STAGES), no segments and no initial state; the output sums a
  piece of every stage run, so none is dropped."""
  pb = pallas_batched
  hb, kd, c = t.heads_per_block, t.key_dim, t.chunk
  chunk_id = pl.program_id(1)

  @pl.when(chunk_id == 0)
  def _():
    state_ref[...] = jnp.zeros(state_ref.shape, F32)

  masks = pb._tri_masks(c)
  q2, k2, g2, v2 = (pb._read(r, t) for r in (q_ref, k_ref, g_ref, v_ref))
  beta = pb._read_beta(b_ref, t)
  if stage >= 1:
    q2, k2, g2, _ = pb._prepare_block(q2, k2, g2, rate_ref[...],
                                      dtb_ref[...], t)
  acc = pb._heads(q2 + k2 + g2 + v2, hb, kd) + beta
  if stage >= 2:
    f = pb._factors(g2, c, t.blocks)
    acc = acc + pb._heads(f["read"] + f["to_end"] + f["rowf"]
                          + sum(f["colfs"]), hb, kd)
  if stage >= 3:
    x = pb._scores(q2, k2, f, t, masks)
    acc = acc + jnp.sum(x["a_qk"] + x["s_kk"], axis=2, keepdims=True)
  if stage >= 4:
    x = pb._ut(x, k2, v2, beta, t, masks)
    acc = acc + x["wu"][:, :, :kd] + x["wu"][:, :, kd:]
  if stage >= 5:
    o, state_ref[...] = pb._state_step(x, q2, k2, state_ref[...],
                                       pb._NO_RUNS, t)
    acc = acc + o
  pb._write(o_ref, pb._lanes(acc), t)

  @pl.when(chunk_id == pl.num_programs(1) - 1)
  def _():
    sf_ref[...] = state_ref[...]


def batched_parts_fn(stage, heads_per_block):
  """f(q, k, v, g, beta, a_log, dt_bias) -> (o, state): the batched
  kernel's forward body up to `stage` on its grid and blocks (raw inputs,
  T a multiple of the chunk), or for "b_kernel" the kernel itself."""
  def f(q, k, v, g, beta, a_log, dt_bias):
    b, seq, h, kd = q.shape
    vd = v.shape[-1]
    interpret = backends.target_platform() != "tpu"
    # The backend's precision: HIGH on every group for float32 at "auto".
    precision = (pallas_backend.FLOAT32_AUTO if q.dtype == F32
                 else precision_lib.resolve("auto", q.dtype))
    if stage == "b_kernel":
      return pallas_batched.kda(
          q, k, v, g, beta, scale=kd ** -0.5, a_log=a_log, dt_bias=dt_bias,
          lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
          precision=precision, heads_per_block=heads_per_block,
          interpret=interpret)
    pb = pallas_batched
    t = pb.Config(chunk=pt.DEFAULT_CHUNK, heads_per_block=heads_per_block,
                  key_dim=kd, value_dim=vd, has_initial_state=False,
                  precision=precision, interpret=interpret,
                  prep=pb.Prep(l2norm=True, scale=kd ** -0.5,
                               lower_bound=-5.0))
    if seq % t.chunk or kd != vd:
      raise ValueError(f"the stages take T a multiple of {t.chunk} and K ="
                       f" V; got T={seq}, K={kd}, V={vd}")
    n, _, spec, view = pb._specs(t, b, seq, h)
    tok = spec["tok"]
    out = pl.pallas_call(
        functools.partial(_batched_parts_kernel, t=t,
                          stage=BATCHED_STAGES.index(stage)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(b * (h // heads_per_block), n),
            in_specs=[tok(kd), tok(kd), tok(vd), tok(kd), spec["rows"],
                      spec["lanes"], spec["lanes"]],
            out_specs=[tok(vd), spec["state"]],
            scratch_shapes=[pltpu.VMEM((heads_per_block, kd, vd), F32)]),
        out_shape=[jax.ShapeDtypeStruct((b, seq, h * vd), q.dtype),
                   jax.ShapeDtypeStruct((b * h, kd, vd), F32)],
        compiler_params=pb._params(pb.vmem_bytes(t, q.dtype, g.dtype)),
        interpret=interpret,
    )(view["tok"](q), view["tok"](k), view["tok"](v), view["tok"](g),
      view["beta"](beta), *pb._gate_lanes(a_log, dt_bias, kd))
    return view["untok"](out[0], vd), out[1]
  return f


def batched_fn(heads_per_block):
  def f(q, k, v, g, beta):
    interpret = backends.target_platform() != "tpu"
    return pallas_batched.kda_forward(
        q, k, v, g, beta, precision=precision_lib.resolve("auto", q.dtype),
        heads_per_block=heads_per_block, lower_bound=-5.0,
        interpret=interpret)
  return f


def accuracy(shape=(1, 1024, 4, 128)):
  """Relative L2 error of both kernels against the float64 recurrence."""
  rows = []
  args = kda_tpu._prepared(*shape, dtype="float32")
  want = [np.asarray(x, np.float64) for x in
          kda_oracle_numpy(*[np.asarray(a, np.float64) for a in args])]
  for dtype in ("float32", "bfloat16"):
    xs = list(args)
    if dtype == "bfloat16":
      xs[:3] = [x.astype(jnp.bfloat16) for x in xs[:3]]
    for setting in (("highest", "default") if dtype == "float32"
                    else ("auto",)):
      p = precision_lib.resolve(setting, xs[0].dtype)
      for name, fn in (("kernel", pt.kda_forward),
                       ("batched", pallas_batched.kda_forward)):
        o, s = jax.jit(functools.partial(
            fn, precision=p, lower_bound=-5.0,
            interpret=backends.target_platform() != "tpu"))(*xs)
        err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b)
                                 / np.linalg.norm(b))
        rows.append(dict(kernel=name, dtype=dtype, precision=setting,
                         out=err(o, want[0]), state=err(s, want[1])))
  return rows


def kda_oracle_numpy(q, k, v, g, beta):
  """The float64 token recurrence (q already scaled): (o, final state)."""
  b, t, h, kd = q.shape
  s = np.zeros((b, h, kd, v.shape[-1]))
  o = np.zeros(v.shape)
  for i in range(t):
    s = s * np.exp(g[:, i])[..., None]
    pred = np.einsum("bhk,bhkv->bhv", k[:, i], s)
    s = s + np.einsum("bhk,bhv->bhkv", k[:, i],
                      beta[:, i][..., None] * (v[:, i] - pred))
    o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], s)
  return o, s


def full_fn(heads_per_block=4):
  def f(q, k, v, g, beta):
    interpret = backends.target_platform() != "tpu"
    return pt.kda_forward(q, k, v, g, beta,
                          precision=precision_lib.resolve("auto", q.dtype),
                          heads_per_block=heads_per_block, lower_bound=-5.0,
                          interpret=interpret)
  return f


def time_ms(fn, args, repeats):
  f = jax.jit(fn)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), compile_s


def _variant_fn(name, heads_per_block, batched_heads):
  """The function variant `name` times (on prepared inputs for the first
  kernel's, raw ones for the batched kernel's b_* stages)."""
  if name in BATCHED_VARIANTS:
    return batched_parts_fn(name, batched_heads)
  parts = VARIANTS[name]
  if parts is None:
    return full_fn(heads_per_block)
  if isinstance(parts, int):
    return batched_fn(parts)
  return parts_fn(parts, heads_per_block)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="kda_tpu_parts", type=cli.output_folder)
  p.add_argument("--shape", default="1,8192,32,128", help="B,T,H,K (K = V)",
                 type=cli.positive_ints)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--heads_per_block", type=cli.positive_int, default=4)
  p.add_argument("--batched_heads", type=cli.positive_int, default=16,
                 help="heads a grid step of the b_* variants")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"of {', '.join(VARIANTS)} (the first kernel) and"
                 f" {', '.join(BATCHED_VARIANTS)} (the batched kernel)")
  p.add_argument("--repeats", type=cli.positive_int, default=5)
  p.add_argument("--accuracy", action="store_true",
                 help="also both kernels against the float64 recurrence")
  a = p.parse_args()
  shape = tuple(a.shape)
  if len(shape) != 4:
    p.error(f"--shape: four integers B,T,H,K; got {a.shape}")
  known = tuple(VARIANTS) + BATCHED_VARIANTS
  unknown = [n for n in a.variants.split(",") if n not in known]
  if unknown:
    p.error(f"--variants: unknown {unknown}; allowed: {', '.join(known)}")
  names = a.variants.split(",")
  args = kda_tpu._prepared(*shape, dtype=a.dtype)
  raw = (kda_tpu.inputs(*shape, dtype=a.dtype)
         if set(names) & set(BATCHED_VARIANTS) else None)
  os.makedirs(a.out, exist_ok=True)
  rows = []
  if a.accuracy:
    rows.append(dict(variant="accuracy", rows=accuracy()))
    print(rows[-1], flush=True)
  for name in names:
    parts = VARIANTS.get(name, name)  # a b_* variant: its stage
    fn = _variant_fn(name, a.heads_per_block, a.batched_heads)
    fn_args = raw if name in BATCHED_VARIANTS else args
    try:
      ms, compile_s = time_ms(fn, fn_args, a.repeats)
      rows.append(dict(variant=name, parts=parts, ms=round(ms, 3),
                       compile_s=round(compile_s, 1)))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(variant=name, parts=parts,
                       error=repr(e)[:1500] + traceback.format_exc()[-1500:]))
    print(rows[-1], flush=True)
    with open(os.path.join(a.out, "kda_tpu_parts.json"), "w") as fh:
      json.dump(dict(device=str(jax.devices()[0].device_kind),
                     jax=jax.__version__, shape=shape, dtype=a.dtype,
                     heads_per_block=a.heads_per_block,
                     batched_heads=a.batched_heads, rows=rows), fh,
                indent=1)


if __name__ == "__main__":
  cli.run_script(main)
