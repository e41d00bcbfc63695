"""The batched-heads Pallas TPU KDA kernel (`ops/kda/pallas_batched.py`).

Off a TPU in Pallas interpret mode; on a TPU the compiled kernel runs
(`INTERPRET`, `testing.pallas_interpret`: interpret mode on the chip runs
the kernel's body as XLA ops at its default precision, 2.6e-4..6.6e-4 on
the float32 outputs on a v5e), and the float64 oracles run on the host
CPU.

Outputs and final states against the float64 NumPy recurrence, every gradient
(its backward kernel) against the float64 `reference` op (whose gradients are
anchored by float64 finite differences), on prepared inputs as in
`test_kda_pallas.py` (whose helpers this file shares); the export to Mosaic for
TPU v5e and v6e; the limits. Measured here (CPU, interpret mode, K = V = 128):
float32 at HIGHEST 1.9e-7..3.8e-7 on the output, gradients 2e-7..5e-7 except dg
with every g at -5 (5.8e-6, an ill-conditioned case: the first kernel gives
6.6e-6 there). The fused backward (`kda(..., fused_backward=True)`, raw inputs)
measured 0.9e-7..5.0e-7 on every gradient (a_log and dt_bias included) in
float32, and 1.8e-3..4.4e-3 with bfloat16 inputs at one pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kda_kernel_program
from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import pallas_batched
from linear_attention.ops.kda.precision import ACCURATE, FAST, Precisions
from tests.ops.test_kda_pallas import (INTERPRET, RTOL_BF16_OUT, RTOL_F32,
                                       _grads_pair, oracle, prepared)

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


def run(args, **kw):
  kw.setdefault("precision", ACCURATE)
  o, state = pallas_batched.kda_forward(*args, interpret=INTERPRET, **kw)
  assert state.dtype == jnp.float32 and o.dtype == args[0].dtype
  return o, state


@pytest.mark.parametrize("t, g, beta, init, h, hb", [
    (64, (-5.0, 0.0), None, False, 2, 2),
    (100, (-5.0, 0.0), None, True, 4, 2),  # padded; two head blocks
    (192, (-5.0, -5.0), None, True, 2, 2),  # every g at the limit
    (192, (-1e-3, 0.0), None, True, 2, 1),  # almost no decay
    (100, (-1e-3, 0.0), 0.0, True, 2, 2),  # no writes: the decayed state
])
def test_matches_the_float64_recurrence(t, g, beta, init, h, hb):
  args = prepared(t, g=g, beta=beta, init=init, h=h)
  o, state = run(args, heads_per_block=hb)
  o_ref, s_ref = oracle(*args)
  testing.assert_close(o, o_ref, rtol=RTOL_F32, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_F32, name="final_state")


def test_bfloat16_inputs_at_one_pass():
  q, k, v, g, beta, s0 = prepared(100, seed=3)
  bf = lambda x: x.astype(jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), g, bf(beta), s0)
  o, state = run(args, precision=FAST)
  o_ref, s_ref = oracle(*args)  # the recurrence on the rounded inputs
  testing.assert_close(o, o_ref, rtol=RTOL_BF16_OUT, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_BF16_OUT, name="final_state")


@pytest.mark.parametrize("t, g, beta, init, chunk, h, b, hb, strided", [
    (100, (-5.0, 0.0), None, True, 64, 2, 1, None, False),
    (192, (-5.0, -5.0), None, False, 64, 2, 1, None, False),
    (160, (-1e-3, 0.0), None, True, 32, 2, 1, None, False),
    (100, (-1.0, 0.0), 1.0, True, 64, 2, 1, None, False),
    (200, (-5.0, 0.0), None, True, 128, 4, 2, 2, False),  # B 2, 2 head blocks
    (100, (-5.0, 0.0), None, True, 64, 4, 2, None, True),  # strided rows
    (64, (-1.0, 0.0), None, False, 32, 8, 1, None, True),
])
def test_gradients_match_the_float64_reference(t, g, beta, init, chunk, h, b,
                                               hb, strided):
  args = prepared(t, g=g, beta=beta, init=init, seed=6, h=h, b=b)
  (out, grads), (out64, grads64) = _grads_pair(
      args, forward=pallas_batched.kda_forward, chunk=chunk,
      heads_per_block=hb, strided=strided)
  for name, x, w in zip(("output", "final_state"), out, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  for name, x, w in zip(NAMES, grads, grads64):
    assert x.dtype == jnp.float32, name
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


def test_gradients_of_bfloat16_inputs():
  q, k, v, g, beta, s0 = prepared(100, h=4, seed=7)
  bf = lambda x: x.astype(jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), g, bf(beta), s0)
  (_, grads), (_, grads64) = _grads_pair(
      args, forward=pallas_batched.kda_forward, precision=FAST,
      heads_per_block=2)
  dtypes = (jnp.bfloat16,) * 3 + (jnp.float32, jnp.bfloat16, jnp.float32)
  for name, x, w, dtype in zip(NAMES, grads, grads64, dtypes):
    assert x.dtype == dtype, name
    # One bfloat16 pass, gradients rounded to bfloat16: the first kernel's
    # bound (its measured 2.4e-3..4.0e-3, twice the largest).
    testing.assert_close(x, np.asarray(w), rtol=8e-3, name=name)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fused, strided, fused_backward", [
    (False, False, False), (True, False, False), (True, True, False),
    (True, False, True), (True, True, True),
    (True, "forward", True)])  # strided forward, backward 16 heads a step
def test_forward_and_backward_export_to_mosaic_for_tpu(chip, dtype, fused,
                                                      strided, fused_backward):
  b, t, h, kd = 1, 200, 16, 128
  s = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  args = (s(b, t, h, kd), s(b, t, h, kd), s(b, t, h, kd),
          s(b, t, h, kd, d=jnp.float32), s(b, t, h, d=jnp.float32),
          s(b, h, kd, kd, d=jnp.float32))
  precision = ACCURATE if dtype == jnp.float32 else FAST
  if fused:  # raw inputs, the lower-bound gate and the L2 norm in the kernel
    a_log, dt_bias = jnp.zeros(h), jnp.zeros(h * kd)
    fwd = lambda *a: pallas_batched.kda(
        *a, scale=kd ** -0.5, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_gate_in_kernel=True, use_qk_l2norm=True, precision=precision,
        strided=bool(strided), fused_backward=fused_backward,
        **(dict(strided_backward=False, heads_per_block=16)
           if strided == "forward" else {}))
  else:
    fwd = lambda *a: pallas_batched.kda_forward(*a, precision=precision,
                                                lower_bound=-5.0)
  loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in fwd(*a))
  with mosaic.lowering_mode(chip):
    forward = jax.export.export(jax.jit(fwd), platforms=["tpu"])(*args)
    grads = jax.export.export(jax.jit(jax.grad(loss, argnums=range(6))),
                              platforms=["tpu"])(*args)
  assert forward.mlir_module().count("tpu_custom_call") == 1
  assert [a.shape for a in forward.out_avals] == [(b, t, h, kd),
                                                  (b, h, kd, kd)]
  assert grads.mlir_module().count("tpu_custom_call") == 2
  assert [a.shape for a in grads.out_avals] == [x.shape for x in args]


def test_limits_raise_not_implemented():
  args = prepared(64)
  with pytest.raises(NotImplementedError, match="every head a step"):
    run(args, heads_per_block=1, strided=True)
  with pytest.raises(NotImplementedError, match="heads_per_block"):
    run(args, heads_per_block=3)
  with pytest.raises(NotImplementedError, match="power of two"):
    run(args, chunk=48)
  with pytest.raises(NotImplementedError, match="lower_bound"):
    run(args, lower_bound=-6.0)


def _raw_inputs(t, h=2, kd=128, b=1, seed=0, dtype=jnp.float32,
                g_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v, g = (x(b, t, h, kd) for _ in range(4))
  beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, h)), jnp.float32)
  a_log = jnp.log(jnp.asarray(rng.uniform(1.0, 16.0, h), jnp.float32))
  dt_bias = x(h * kd) * 0.5
  s0 = x(b, h, kd, kd) * 0.5
  cast = lambda a: a.astype(dtype)
  return ((cast(q), cast(k), cast(v), g.astype(g_dtype), cast(beta), s0),
          a_log, dt_bias)


RAW_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "ds0", "da_log", "ddt_bias")


def _raw_pair(t, *, gated, l2norm, h=2, b=1, init=True, dtype=jnp.float32,
              precision=ACCURATE, g_dtype=jnp.float32, every=None,
              lower_bound=-5.0, **kernel_kw):
  """(out, grads), (out64, grads64): `pallas_batched.kda` and the float64
  `reference` op on the same raw inputs (rounded to `dtype`), under one
  random cotangent. grads follow RAW_NAMES (None where no input). `every`:
  with the chunk-boundary states (a third output) every that many tokens."""
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(
      t, h=h, b=b, seed=t, dtype=dtype, g_dtype=g_dtype)
  if not gated:
    g = -5.0 * jax.nn.sigmoid(g)  # a log decay in [-5, 0]
  if not l2norm:  # unit keys keep the delta rule contractive
    q, k = ((x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1,
                                 keepdims=True)).astype(dtype)
            for x in (q, k))
  if not init:
    s0 = None
  kw = dict(scale=128 ** -0.5, lower_bound=lower_bound if gated else None,
            use_gate_in_kernel=gated, use_qk_l2norm=l2norm)
  args = (q, k, v, g, beta, s0, a_log, dt_bias)
  states = {} if every is None else dict(chunk_states_every=every)

  def ours(q, k, v, g, beta, s0, a_log, dt_bias):
    return pallas_batched.kda(q, k, v, g, beta, s0, a_log=a_log,
                              dt_bias=dt_bias, precision=precision,
                              interpret=INTERPRET, **kw, **kernel_kw,
                              **states)

  def reference(q, k, v, g, beta, s0, a_log, dt_bias):
    return ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log if gated else None,
        dt_bias=dt_bias if gated else None, initial_state=s0,
        output_final_state=True, backend="reference", precision="highest",
        **kw, **({} if every is None else dict(output_chunk_states=True,
                                                **states)))

  rng = np.random.default_rng(1)
  cots = [rng.normal(size=v.shape), rng.normal(size=(b, h, 128, 128))]
  if every is not None:
    cots.append(rng.normal(size=(b, t // every, h, 128, 128)))
  out, back = jax.vjp(ours, *args)
  grads = back(tuple(jnp.asarray(c, x.dtype) for c, x in zip(cots, out)))
  with testing.float64_on_host():
    a64 = [None if a is None else jnp.asarray(np.asarray(
        a.astype(jnp.float32), np.float64)) for a in args]
    out64, back64 = jax.vjp(reference, *a64)
    grads64 = back64(tuple(map(jnp.asarray, cots)))
  return (out, grads), (out64, grads64)


@pytest.mark.parametrize("gated, l2norm, t, strided", [
    (True, True, 100, False), (False, True, 64, False),
    (True, False, 130, False), (True, True, 100, True)])
def test_fused_preparation_forward_and_gradients(gated, l2norm, t, strided):
  # The kernel normalises q and k, scales q and activates the lower-bound
  # gate itself; the backward in its other form (`fused_backward=False`:
  # prepared in XLA and pulled back there); every gradient (a_log and
  # dt_bias included) against the float64 reference op on the same inputs.
  (out, grads), (out64, grads64) = _raw_pair(t, gated=gated, l2norm=l2norm,
                                             strided=strided,
                                             fused_backward=False)
  for name, x, w in zip(("output", "final_state"), out, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  for name, x, w in list(zip(RAW_NAMES, grads, grads64))[:6 if not gated
                                                          else 8]:
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


@pytest.mark.parametrize("gated, l2norm, t, h, hb, chunk, init, strided", [
    (True, True, 100, 2, 2, 64, True, False),  # padded: raw gate -inf there
    (True, True, 64, 8, 8, 32, False, False),  # 8 heads a step, no state
    (True, True, 40, 16, 16, 32, True, False),  # 16 heads a step, padded
    (True, True, 100, 4, 2, 64, True, False),  # two head blocks
    (False, True, 64, 2, 2, 64, True, False),  # the log decay given
    (True, False, 130, 2, 1, 64, True, False),  # no L2 norm, padded
    (True, True, 100, 4, None, 64, True, True),  # strided rows
])
def test_fused_backward_gradients(gated, l2norm, t, h, hb, chunk, init,
                                  strided):
  # The backward kernel prepares the raw block and pulls every gradient
  # back through the preparation itself, a_log and dt_bias summed over the
  # chunks in the kernel; against the float64 reference op, at the bounds
  # of the gradients above.
  (out, grads), (out64, grads64) = _raw_pair(
      t, gated=gated, l2norm=l2norm, h=h, init=init, heads_per_block=hb,
      chunk=chunk, strided=strided, fused_backward=True)
  for name, x, w in zip(("output", "final_state"), out, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  checked = 0
  for name, x, w in zip(RAW_NAMES, grads, grads64):
    if name == "ds0" and not init or name in ("da_log", "ddt_bias") and (
        not gated):
      continue
    assert x.dtype == jnp.float32, name
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
    checked += 1
  assert checked == 5 + init + 2 * gated


def test_fused_backward_sums_a_log_and_dt_bias_over_a_batch():
  # Two sequences, two head blocks: each (batch row, head block) sums its
  # own chunks in the kernel, and XLA adds the rows; against float64.
  (out, grads), (out64, grads64) = _raw_pair(
      100, gated=True, l2norm=True, h=4, b=2, heads_per_block=2,
      fused_backward=True)
  for name, x, w in zip(("output", "final_state"), out, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  for name, x, w in zip(RAW_NAMES, grads, grads64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_strided_forward_with_an_unstrided_backward(dtype):
  # The strided forward's chunk states feed the unstrided fused backward
  # (two head blocks of 2; `test_a_strided_forward_hands_its_backward_to_
  # unstrided_blocks` shows which kernels run): the output, final state and
  # every gradient against the float64 reference op, at the bounds of the
  # tests above for each dtype.
  f32 = dtype == jnp.float32
  (out, grads), (out64, grads64) = _raw_pair(
      100, gated=True, l2norm=True, h=4, dtype=dtype,
      precision=ACCURATE if f32 else FAST, heads_per_block=2, strided=True,
      strided_backward=False, fused_backward=True)
  testing.assert_close(out[0], np.asarray(out64[0]),
                       rtol=RTOL_F32 if f32 else RTOL_BF16_OUT, name="output")
  testing.assert_close(out[1], np.asarray(out64[1]),
                       rtol=RTOL_F32 if f32 else RTOL_BF16_OUT,
                       name="final_state")
  for name, x, w in zip(RAW_NAMES, grads, grads64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32 if f32 else 8e-3,
                         name=name)


@pytest.mark.parametrize("b, t, every, kernel_kw", [
    (1, 200, 64, dict(heads_per_block=2)),  # two head blocks, every chunk
    (2, 260, 128, dict(strided=True)),  # strided rows, two sequences
    (1, 200, 64, dict(strided=True, strided_backward=False,
                      heads_per_block=2)),
    (1, 200, 128, dict(heads_per_block=2, fused_backward=False)),  # in XLA
    (1, 200, 64, dict(heads_per_block=2, strided_primal=True)),
])
def test_chunk_boundary_states_in_the_one_pass(b, t, every, kernel_kw):
  # `chunk_states_every`: the forward kernel writes its carried state at
  # every C-th token and the backward adds their cotangents there. T not a
  # multiple of the chunk (a tail after the last boundary); the output,
  # final state, boundary states and every gradient against the float64
  # reference op's. Measured in interpret mode at HIGHEST: boundary states
  # 8.2e-8..9.4e-8, gradients 1.2e-7..4.8e-7 (d a_log up to 8.7e-7).
  (out, grads), (out64, grads64) = _raw_pair(
      t, gated=True, l2norm=True, h=4, b=b, every=every, **kernel_kw)
  assert out[2].shape == (b, t // every, 4, 128, 128)
  assert out[2].dtype == jnp.float32
  # Not differentiated (`strided_primal`: the strided forward) as well.
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(t, h=4, b=b, seed=t)
  primal = pallas_batched.kda(
      q, k, v, g, beta, s0, scale=128 ** -0.5, a_log=a_log, dt_bias=dt_bias,
      lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
      precision=ACCURATE, chunk_states_every=every, interpret=INTERPRET,
      **kernel_kw)
  for name, x, y, w in zip(("output", "final_state", "chunk_states"), out,
                           primal, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
    testing.assert_close(y, np.asarray(w), rtol=RTOL_F32, name=name)
  for name, x, w in zip(RAW_NAMES, grads, grads64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


def test_chunk_boundary_states_limits():
  args = _raw_inputs(100)
  (q, k, v, g, beta, s0), a_log, dt_bias = args
  kw = dict(scale=128 ** -0.5, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
            use_gate_in_kernel=True, precision=ACCURATE, interpret=INTERPRET)
  with pytest.raises(NotImplementedError, match="multiple of the chunk"):
    pallas_batched.kda(q, k, v, g, beta, s0, chunk_states_every=96, **kw)
  with pytest.raises(ValueError, match="chunk_states_every"):
    pallas_batched.kda(q, k, v, g, beta, s0, chunk_states_every=0, **kw)
  ids = jnp.ones((1, 100), jnp.int32)
  with pytest.raises(NotImplementedError, match="per-segment states"):
    pallas_batched.kda(q, k, v, g, beta, None, segment_ids=ids,
                       num_segments=1, chunk_states_every=64, **kw)
  # No boundary inside T: an empty third output.
  o, final, states = pallas_batched.kda(q, k, v, g, beta, s0,
                                        chunk_states_every=128, **kw)
  assert states.shape == (1, 0, 2, 128, 128)


def _factor_errors(g):
  """Largest absolute errors of `_factors`' read, to_end and every causal
  pair rowf[i] colf[j] = exp(G_i - G_j) against float64, one chunk."""
  f = pallas_batched._factors(g, 64, 4)
  big = np.cumsum(np.asarray(g, np.float64), axis=0)
  err = lambda a, w: float(np.abs(np.asarray(a, np.float64) - w).max())
  pairs = max(err(np.asarray(f["rowf"][i], np.float64)
                  * np.asarray(f["colfs"][i // 16][:i + 1], np.float64),
                  np.exp(big[i] - big[:i + 1]))
              for i in range(64))
  return dict(read=err(f["read"], np.exp(big)),
              to_end=err(f["to_end"], np.exp(big[-1:] - big)), pairs=pairs)


@pytest.mark.parametrize("seed", [0, 1])
def test_exponent_factors_match_float64(seed):
  # The factorization's arithmetic, on the host CPU (the chip's own exp is
  # measured by benchmarks/elementwise_accuracy.py): log decays down to the
  # gate's -5, one 64-token chunk of 256 lanes, exp(G), exp(G_C - G) and
  # every causal pair's two factors against float64 (absolute errors; each
  # value is at most 1). Measured (seeds 0, 1): read 3.4e-8, to_end 3.8e-8,
  # pairs 5.5e-6 (the pair's two exponents reach +-40, so each factor's
  # argument carries about 40 x 6e-8 of rounding).
  with jax.default_device(jax.devices("cpu")[0]):
    g = jax.random.uniform(jax.random.key(seed), (64, 256), minval=-5.0,
                           maxval=0.0)
    errors = _factor_errors(g)
  assert errors["read"] <= 1e-7 and errors["to_end"] <= 1e-7, errors
  assert errors["pairs"] <= 1.1e-5, errors


def pallas_calls(jaxpr):
  """Every pallas_call equation in `jaxpr` and its sub-jaxprs, in order."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(eqn)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += pallas_calls(sub)
  return found


def pallas_grids(jaxpr):
  """The grid of every pallas_call in `jaxpr` and its sub-jaxprs, in order."""
  return [tuple(e.params["grid_mapping"].grid) for e in pallas_calls(jaxpr)]


def test_strided_gradients_of_bfloat16_inputs_and_gate():
  # q, k, v, beta and the raw gate in bfloat16, strided: all four gradient
  # blocks through the one float32 scratch in turn (`_rows_scratch`), each
  # against the float64 reference op at the bound of the bfloat16 tests
  # above (8e-3; measured in interpret mode: output 3.8e-3, gradients
  # 1.4e-3..4.8e-3).
  (out, grads), (out64, grads64) = _raw_pair(
      100, gated=True, l2norm=True, h=4, dtype=jnp.bfloat16,
      g_dtype=jnp.bfloat16, precision=FAST, strided=True,
      fused_backward=True)
  testing.assert_close(out[0], np.asarray(out64[0]), rtol=RTOL_BF16_OUT,
                       name="output")
  for name, x, w in zip(RAW_NAMES, grads, grads64):
    testing.assert_close(x, np.asarray(w), rtol=8e-3, name=name)


def _pallas_outputs(jaxpr):
  """The output dtypes of every pallas_call in `jaxpr` and its
  sub-jaxprs, in order."""
  return [tuple(v.aval.dtype for v in e.outvars)
          for e in pallas_calls(jaxpr)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_strided_kernels_write_in_the_inputs_dtype(dtype):
  # Strided 16-bit rows go through a float32 scratch in the kernels
  # (`_rows_scratch`), so each kernel writes the output and the gradients
  # of q, k, v and g in the inputs' dtype itself: no float32 rows through
  # HBM and no cast after (0.31 ms of the forward and 1.23 ms of the
  # forward+backward at B1 T8192 H32 on a v5e before); the values are
  # checked in the bfloat16 tests above.
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(100, h=4, dtype=dtype)
  run = lambda q: pallas_batched.kda(
      q, k, v, g, beta, s0, scale=1.0, a_log=a_log, dt_bias=dt_bias,
      lower_bound=-5.0, use_gate_in_kernel=True, precision=FAST,
      strided=True, interpret=INTERPRET)
  (o_dtype, state_dtype), = _pallas_outputs(jax.make_jaxpr(run)(q).jaxpr)
  assert (o_dtype, state_dtype) == (dtype, jnp.float32)
  loss = lambda q: jnp.sum(run(q)[0].astype(jnp.float32))
  _, backward = _pallas_outputs(jax.make_jaxpr(jax.grad(loss))(q).jaxpr)
  assert backward[:4] == (q.dtype, k.dtype, v.dtype, g.dtype), backward


def test_a_strided_forward_hands_its_backward_to_unstrided_blocks():
  # Forward: one grid row (all 4 heads a step); backward: two (2 heads a
  # step), so the gradients above come from the unstrided kernel.
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(100, h=4)

  def loss(q):
    o, s = pallas_batched.kda(
        q, k, v, g, beta, s0, scale=1.0, a_log=a_log, dt_bias=dt_bias,
        lower_bound=-5.0, use_gate_in_kernel=True, precision=ACCURATE,
        heads_per_block=2, strided=True, strided_backward=False,
        interpret=INTERPRET)
    return jnp.sum(o) + jnp.sum(s)

  assert pallas_grids(jax.make_jaxpr(jax.grad(loss))(q).jaxpr) == [
      (1, 2), (2, 2)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_strided_primal_runs_the_strided_forward_only_undifferentiated(dtype):
  # `strided_primal`: a call that is not differentiated runs one grid row
  # (all 4 heads a step, strided); under a gradient the forward and the
  # backward run two (2 heads a step). Both outputs against the float64
  # reference op at the bounds above, and the differentiated call's
  # gradients too.
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(100, h=4, seed=100,
                                                       dtype=dtype)
  f32 = dtype == jnp.float32

  def run(q, k, v, g, beta, s0, a_log, dt_bias):
    return pallas_batched.kda(
        q, k, v, g, beta, s0, scale=128 ** -0.5, a_log=a_log,
        dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True,
        use_qk_l2norm=True, precision=ACCURATE if f32 else FAST,
        heads_per_block=2, strided_primal=True, interpret=INTERPRET)

  args = (q, k, v, g, beta, s0, a_log, dt_bias)
  loss = lambda *a: jnp.sum(run(*a)[0].astype(jnp.float32))
  assert pallas_grids(jax.make_jaxpr(run)(*args).jaxpr) == [(1, 2)]
  assert pallas_grids(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr) == [
      (2, 2), (2, 2)]
  (out, grads), (out64, grads64) = _raw_pair(
      100, gated=True, l2norm=True, h=4, dtype=dtype,
      precision=ACCURATE if f32 else FAST, heads_per_block=2,
      strided_primal=True)
  primal = jax.jit(run)(*args)
  for name, x, y, w in zip(("output", "final_state"), primal, out, out64):
    for value in (x, y):  # undifferentiated, differentiated
      testing.assert_close(value, np.asarray(w),
                           rtol=RTOL_F32 if f32 else RTOL_BF16_OUT, name=name)
  for name, x, w in zip(RAW_NAMES, grads, grads64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32 if f32 else 8e-3,
                         name=name)


def test_strided_primal_takes_no_packed_segments():
  (q, k, v, g, beta, _), a_log, dt_bias = _raw_inputs(64, h=4)
  ids = jnp.ones((1, 64), jnp.int32)
  with pytest.raises(NotImplementedError, match="strided_primal"):
    pallas_batched.kda(q, k, v, g, beta, None, scale=1.0, a_log=a_log,
                       dt_bias=dt_bias, lower_bound=-5.0,
                       use_gate_in_kernel=True, precision=ACCURATE,
                       strided_primal=True, segment_ids=ids,
                       interpret=INTERPRET)


def test_an_unstrided_backward_only_in_the_fused_form():
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(64, h=4)
  with pytest.raises(NotImplementedError, match="fused form"):
    pallas_batched.kda(q, k, v, g, beta, s0, scale=1.0, a_log=a_log,
                       dt_bias=dt_bias, lower_bound=-5.0,
                       use_gate_in_kernel=True, precision=ACCURATE,
                       strided=True, strided_backward=False,
                       fused_backward=False, interpret=INTERPRET)


@pytest.mark.parametrize("strided", [False, True])
def test_fused_backward_gradients_of_bfloat16_inputs(strided):
  # bfloat16 q, k, v, beta at one pass, their gradients written in bfloat16
  # by the kernel (strided: through a float32 scratch); the bounds of
  # `test_gradients_of_bfloat16_inputs` (measured 1.8e-3..4.4e-3).
  (out, grads), (out64, grads64) = _raw_pair(
      100, gated=True, l2norm=True, h=4, dtype=jnp.bfloat16,
      precision=FAST, heads_per_block=None if strided else 2,
      strided=strided, fused_backward=True)
  # The output in the inputs' dtype (strided: through a float32 scratch in
  # the kernel, `test_the_strided_kernels_write_in_the_inputs_dtype`).
  assert out[0].dtype == jnp.bfloat16
  testing.assert_close(out[0], np.asarray(out64[0]), rtol=RTOL_BF16_OUT,
                       name="output")
  dtypes = (jnp.bfloat16,) * 3 + (jnp.float32, jnp.bfloat16) + (
      jnp.float32,) * 3
  for name, x, w, dtype in zip(RAW_NAMES, grads, grads64, dtypes):
    assert x.dtype == dtype, name
    testing.assert_close(x, np.asarray(w), rtol=8e-3, name=name)


def test_fused_preparation_refuses_the_softplus_gate():
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(64)
  with pytest.raises(NotImplementedError, match="lower-bound gate"):
    pallas_batched.kda(q, k, v, g, beta, s0, scale=1.0, a_log=a_log,
                       dt_bias=dt_bias, use_gate_in_kernel=True,
                       precision=ACCURATE, interpret=INTERPRET)


def _segment_layouts(t):
  """[2, t] segment ids (t >= 150): runs starting inside chunks and on a
  chunk edge, padding in the middle (a run resumed across it and across a
  chunk edge), a segment met again after another one (a new run, from a
  zero state), leading and trailing padding, a one-token segment and, at
  32-token chunks, a chunk of padding only."""
  seg = np.zeros((2, t), np.int32)
  # 64:96 padding: a whole chunk of it at 32-token chunks, inside the run of
  # segment 2 that resumes at 96 (across a chunk edge at 64-token chunks).
  seg[0, :30], seg[0, 30:64], seg[0, 96:128] = 1, 2, 2
  seg[0, 128:150], seg[0, 150:t - 3] = 3, 1  # 128: a start on a chunk edge
  seg[1, 5:100], seg[1, 100], seg[1, 140:] = 1, 2, 4  # 101:140 padding
  return seg


def _segments_pair(t, seg, *, gated=True, dtype=jnp.float32,
                   precision=ACCURATE, states=False, **kernel_kw):
  """(grads, grads64): the output and every gradient (RAW_NAMES without
  ds0) of `pallas_batched.kda` with `segment_ids` and of the float64
  `reference` op on the same raw inputs, under one random cotangent. With
  `states`, per-segment states as well (`num_segments=4`): random initial
  states [B, 4, H, K, V], the final states under a second cotangent, and
  the initial states' gradient."""
  (q, k, v, g, beta, _), a_log, dt_bias = _raw_inputs(t, h=4, b=2, seed=t,
                                                      dtype=dtype)
  if not gated:
    g = -5.0 * jax.nn.sigmoid(g)  # a log decay in [-5, 0]
  kw = dict(scale=128 ** -0.5, lower_bound=-5.0 if gated else None,
            use_gate_in_kernel=gated, use_qk_l2norm=True)
  ids = jnp.asarray(seg)
  rng = np.random.default_rng(1)
  s0 = jnp.asarray(rng.normal(size=(2, 4, 4, 128, 128)) * 0.5, jnp.float32)
  per_segment = dict(num_segments=4) if states else {}

  def ours(*args):
    o, final = pallas_batched.kda(
        *args[:5], args[7] if states else None, a_log=args[5],
        dt_bias=args[6], segment_ids=ids, precision=precision,
        interpret=INTERPRET, **kw, **kernel_kw, **per_segment)
    assert (final is None) != states
    return (o, final) if states else o

  def reference(*args):
    o, final = ops.kimi_delta_attention(
        *args[:5], a_log=args[5] if gated else None,
        dt_bias=args[6] if gated else None, segment_ids=ids,
        initial_state=args[7] if states else None,
        output_final_state=states, max_num_segments=4, backend="reference",
        precision="highest", **kw)
    return (o, final) if states else o

  args = (q, k, v, g, beta, a_log, dt_bias) + ((s0,) if states else ())
  do = rng.normal(size=v.shape)
  cot = ((jnp.asarray(do, dtype), jnp.asarray(rng.normal(size=s0.shape),
                                              jnp.float32))
         if states else jnp.asarray(do, dtype))
  out, back = jax.vjp(ours, *args)
  out = out if states else (out,)
  grads = (*out, *back(cot))
  with testing.float64_on_host():
    out64, back64 = jax.vjp(reference, *[
        jnp.asarray(np.asarray(a.astype(jnp.float32), np.float64))
        for a in args])
    out64 = out64 if states else (out64,)
    grads64 = (*out64, *back64(jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x, np.float64)), cot)))
  names = ("output",) + ("final_state",) * states + tuple(
      n for n in RAW_NAMES if n != "ds0")
  pairs = list(zip(names, grads, grads64))
  if states:
    pairs.append(("ds0", grads[-1], grads64[-1]))
  if not gated:
    pairs = [p for p in pairs if p[0] not in ("da_log", "ddt_bias")]
  return pairs


@pytest.mark.parametrize("gated, chunk, hb, fused_backward", [
    (True, 64, 2, False),  # the backward prepares in XLA
    (True, 64, 4, True),  # the fused backward, 4 heads a step
    (False, 32, 2, True),  # the log decay given; a chunk of padding only
])
def test_packed_segments_match_the_float64_reference(gated, chunk, hb,
                                                     fused_backward):
  # Runs restrict each chunk's pairs and its reads and writes of the carried
  # state; padding writes zeros and leaves the state alone. Measured on CPU
  # (interpret mode): 2.6e-7..5.3e-7, dg and d dt_bias 1.2e-6..1.5e-6.
  pairs = _segments_pair(200, _segment_layouts(200), gated=gated,
                         chunk=chunk, heads_per_block=hb,
                         fused_backward=fused_backward)
  for name, x, w in pairs:
    assert x.dtype == jnp.float32, name
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  assert len(pairs) == (8 if gated else 6)


@pytest.mark.parametrize("gated, chunk, hb, fused_backward", [
    (True, 64, 4, True),  # the fused backward, 4 heads a step
    (False, 32, 2, False),  # the log decay given; the XLA pull-back
])
def test_per_segment_states_match_the_float64_reference(gated, chunk, hb,
                                                        fused_backward):
  # Every run starts on a chunk edge from its segment's initial state (a
  # segment met again starts from it again), each segment's final state is
  # its last run's, an absent segment's its initial state. The layouts of
  # the test above: 4 and 3 runs a row. Measured on CPU (interpret mode):
  # 1.0e-7..3.8e-7 on the output and the gradients, 1.5e-8..2.2e-8 on the
  # final states, 6.7e-9..1.7e-8 on the initial states' gradient.
  pairs = _segments_pair(160, _segment_layouts(160), gated=gated,
                         chunk=chunk, heads_per_block=hb,
                         fused_backward=fused_backward, states=True)
  for name, x, w in pairs:
    assert x.dtype == jnp.float32, name
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  assert [n for n, _, _ in pairs][:2] == ["output", "final_state"]
  assert len(pairs) == (10 if gated else 8)


def test_realigned_runs_start_on_chunk_edges():
  # `_realign` against the layout built by hand: each run from a chunk edge,
  # tokens in order, padding after a token kept in its run, the padding
  # before a row's first token dropped; the chunks' runs and flags.
  seg = np.array([[0, 0, 1, 1, 0, 2, 2, 2, 2, 2, 1, 0]], np.int32)
  lay = pallas_batched._realign(jnp.asarray(seg), 4, 3, 4)
  # runs: [2, 5) of 1 (with its padding), [5, 10) of 2, [10, 12) of 1.
  place = [24, 24, 0, 1, 2, 4, 5, 6, 7, 8, 12, 13]
  assert lay["place"].tolist() == [place]
  tp = lay["src"].shape[1]
  assert tp == 12 + 4 * 3 == 24
  src = np.zeros(tp, np.int32)
  valid = np.zeros(tp, np.int32)
  for tok, at in enumerate(place):
    if at < tp:
      src[at], valid[at] = tok, seg[0, tok] > 0
  np.testing.assert_array_equal(lay["src"][0], src)
  np.testing.assert_array_equal(lay["valid"][0], valid)
  # chunks of 4: run 0 in chunk 0, run 1 in chunks 1-2, run 2 in chunk 3,
  # then padding (run 2 still: the state passes through unchanged).
  assert lay["chunk_run"].tolist() == [[0, 1, 1, 2, 2, 2]]
  assert lay["flags"].tolist() == [[3, 1, 2, 1, 0, 2]]
  assert lay["run_segment"].tolist() == [[1, 2, 1, 0]]
  assert lay["last_run"].tolist() == [[2, 1, -1]]
  assert lay["over"].tolist() == [False]
  assert pallas_batched._realign(jnp.asarray(seg), 2, 3, 4)["over"].tolist(
      ) == [True]


def test_more_runs_than_segments_give_nan_not_a_wrong_answer():
  # The layout holds at most num_segments runs a row and their states; a
  # row with more runs or a larger id gets NaN (backend `pallas` sends such
  # calls to `chunked`), the others are computed. num_segments=2; row 0:
  # segments 1, 2, 1 (three runs); row 1: 1, 2; row 2: 1, 3.
  (q, k, v, g, beta, _), a_log, dt_bias = _raw_inputs(64, h=2, b=3)
  ids = np.ones((3, 64), np.int32)
  ids[0, 20:40] = 2
  ids[1, 32:] = 2
  ids[2, 32:] = 3
  assert pallas_batched.too_many_runs(jnp.asarray(ids), 2).tolist() == [
      True, False, True]
  o, final = pallas_batched.kda(
      q, k, v, g, beta, scale=128 ** -0.5, a_log=a_log, dt_bias=dt_bias,
      lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
      precision=ACCURATE, segment_ids=jnp.asarray(ids), num_segments=2,
      interpret=INTERPRET)
  for row in (0, 2):
    assert np.all(np.isnan(o[row])) and np.all(np.isnan(final[row])), row
  assert np.all(np.isfinite(o[1])) and np.all(np.isfinite(final[1]))


# The gate's gradients with bfloat16 inputs at one pass and no final-state
# cotangent (the bfloat16 tests above have one, which dominates them): each
# is a sum of many cancelling terms, like d a_log on the chip (test_kda.py).
# Measured on CPU (interpret mode) with these segments: dg 2.4e-2, d a_log
# 1.5e-2, d dt_bias 4.6e-2; on the same inputs with every token in one
# segment 2.5e-2 / 7.3e-3 / 5.6e-2, and without segment_ids dg 2.5e-2.
# Above every value measured (the largest 5.6e-2):
BF16_GATE_GRADS_RTOL = 1e-1


def test_packed_segments_in_bfloat16_at_one_pass():
  # bfloat16 inputs, the fused backward; the output and q, k, v, beta
  # gradients at the bounds of the bfloat16 tests above (measured
  # 3.9e-3..4.2e-3).
  pairs = _segments_pair(160, _segment_layouts(160), dtype=jnp.bfloat16,
                         precision=FAST, fused_backward=True)
  for name, x, w in pairs:
    rtol = {"output": RTOL_BF16_OUT, "dg": BF16_GATE_GRADS_RTOL,
            "da_log": BF16_GATE_GRADS_RTOL,
            "ddt_bias": BF16_GATE_GRADS_RTOL}.get(name, 8e-3)
    testing.assert_close(x, np.asarray(w), rtol=rtol, name=name)


@pytest.mark.parametrize("fused_backward, states", [
    (False, False), (True, False), (False, True), (True, True)])
def test_packed_segments_export_to_mosaic_for_tpu_v5e(fused_backward, states):
  # With per-segment states the kernels read two scalar-prefetched rows
  # and index the state blocks by them.
  b, t, h, kd = 1, 200, 16, 128
  args = [jax.ShapeDtypeStruct((b, t, h, kd), d) for d in
          (jnp.bfloat16,) * 3 + (jnp.float32,)]
  args += [jax.ShapeDtypeStruct((b, t, h), jnp.bfloat16)]
  if states:
    args += [jax.ShapeDtypeStruct((b, 3, h, kd, kd), jnp.float32)]
  ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
  a_log, dt_bias = jnp.zeros(h), jnp.zeros(h * kd)

  def loss(q, k, v, g, beta, *rest):
    *s0, ids = rest
    o, final = pallas_batched.kda(
        q, k, v, g, beta, *s0, scale=kd ** -0.5, a_log=a_log,
        dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True,
        use_qk_l2norm=True, precision=FAST, fused_backward=fused_backward,
        segment_ids=ids, num_segments=3 if states else None)
    extra = jnp.sum(final) if states else 0.0
    return jnp.sum(o.astype(jnp.float32) ** 2) + extra

  with mosaic.lowering_mode("v5e"):
    grads = jax.export.export(
        jax.jit(jax.grad(loss, argnums=range(len(args)))),
        platforms=["tpu"])(*args, ids)
  assert grads.mlir_module().count("tpu_custom_call") == 2
  assert [a.shape for a in grads.out_avals] == [x.shape for x in args]


def test_packed_segments_drop_whatever_padding_holds():
  # NaN in padding's q, k, v and g leaves every output and the gradients of
  # v, beta and the gate's parameters finite and unchanged, as the chunked
  # backend does (padding is selected away as it is read). The q and k
  # gradients are not compared: chunked's are NaN at such padding (the L2
  # norm's pull-back of a NaN row).
  (q, k, v, g, beta, _), a_log, dt_bias = _raw_inputs(96, h=2)
  ids = np.ones((1, 96), np.int32)
  ids[0, 40:70] = 0  # a run resumed across padding and a chunk edge
  bad = lambda x: x.at[0, 45:60].set(jnp.nan)

  def run(q, k, v, g):
    o, back = jax.vjp(lambda v, beta, a, d: pallas_batched.kda(
        q, k, v, g, beta, scale=128 ** -0.5, a_log=a, dt_bias=d,
        lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
        precision=ACCURATE, segment_ids=jnp.asarray(ids), fused_backward=True,
        interpret=INTERPRET)[0], v, beta, a_log, dt_bias)
    return (o, *back(jnp.ones_like(o)))

  clean, dirty = run(q, k, v, g), run(bad(q), bad(k), bad(v), bad(g))
  for name, x, w in zip(("output", "dv", "dbeta", "da_log", "ddt_bias"),
                        dirty, clean):
    testing.assert_close(x, w, rtol=1e-6, name=name)


def test_packed_segments_limits():
  (q, k, v, g, beta, s0), a_log, dt_bias = _raw_inputs(64)
  kw = dict(scale=1.0, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
            use_gate_in_kernel=True, precision=ACCURATE, interpret=INTERPRET)
  ids = jnp.ones((1, 64), jnp.int32)
  with pytest.raises(ValueError, match="num_segments N"):  # [B, H, K, V]
    pallas_batched.kda(q, k, v, g, beta, s0, segment_ids=ids, **kw)
  with pytest.raises(ValueError, match=r"\[B, N, H, K, V\] = \(1, 2, 2"):
    pallas_batched.kda(q, k, v, g, beta, s0, segment_ids=ids, num_segments=2,
                       **kw)
  for bad in (0, 1.5):
    with pytest.raises(ValueError, match="num_segments must be an int"):
      pallas_batched.kda(q, k, v, g, beta, segment_ids=ids, num_segments=bad,
                         **kw)
  with pytest.raises(ValueError, match="num_segments is for packed"):
    pallas_batched.kda(q, k, v, g, beta, num_segments=2, **kw)
  with pytest.raises(NotImplementedError, match="strided"):
    pallas_batched.kda(q, k, v, g, beta, segment_ids=ids, strided=True, **kw)
  with pytest.raises(ValueError, match="segment_ids"):
    pallas_batched.kda(q, k, v, g, beta, segment_ids=ids[:, :32], **kw)


_P = jax.lax.Precision


def test_products_round_as_on_the_chip():
  # The kernel's products at each precision, against float64, on any
  # device: DEFAULT one bfloat16 pass, HIGH three (bf16x3, written out, so
  # not exact float32 on a CPU), HIGHEST float32. Measured here at
  # [64, 128] x [128, 128]: 2.4e-3, 4.5e-6, 2.0e-7.
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(2, 64, 128)), rng.normal(size=(2, 128, 128))
  exact = np.einsum("bmk,bkn->bmn", a, b)
  err = {p: testing.relative_l2_error(pallas_batched._dot(
      jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
      pallas_batched._BATCH_NN, p), exact)
         for p in (_P.DEFAULT, _P.HIGH, _P.HIGHEST)}
  assert 1e-3 < err[_P.DEFAULT] < 5e-3, err
  assert 1e-6 < err[_P.HIGH] < 2e-5, err
  assert err[_P.HIGHEST] < 1e-6, err



@pytest.mark.parametrize("config", sorted(kda_kernel_program.CONFIGS))
@pytest.mark.parametrize("strided", [False, True])
def test_each_operand_is_cast_to_bfloat16_once(config, strided):
  # A value several products read (the state and its cotangent, dO, V_new,
  # the solve's factors, the scores' operands, which the backward reads
  # again) is split (HIGH) or cast (DEFAULT) once, not at every product:
  # before `_Operand`, 0.52 M elements of the forward kernel's and 2.36 M
  # of the backward's casts a grid step repeated one already made
  # (benchmarks/results/kda_kernel_program_*.json).
  for kernel, counts in kda_kernel_program.programs(
      config, strided=strided).items():
    assert counts["products"]["count"] > 0, kernel
    assert counts["bf16_casts"] > 0, kernel
    assert counts["repeated_bf16_casts"] == 0, (kernel, counts)

# The op's float32 bounds (tests/ops/test_kda_device_accuracy.py): output and
# state 1e-5, gradients 1e-4, those of g, beta and the gate's parameters 5e-4.
F32_OP_BOUNDS = dict(output=1e-5, final_state=1e-5, dq=1e-4, dk=1e-4, dv=1e-4,
                     ds0=1e-4, dg=5e-4, dbeta=5e-4, da_log=5e-4,
                     ddt_bias=5e-4)


@pytest.mark.parametrize("precision, fused_backward", [
    (Precisions.every(_P.HIGH), False),
    (Precisions(scores=_P.HIGHEST, solve=_P.HIGH, state=_P.HIGHEST,
                output=_P.HIGH), True)])
def test_float32_at_three_passes_keeps_the_op_bounds(precision,
                                                     fused_backward):
  # HIGH is three bfloat16 products written out (`_dot`), so these are the
  # chip's numbers, not exact float32 ones. Measured here (T = 1024): HIGH
  # everywhere 6.6e-6 on the output (the tightest margin, 1.5x), 3.5e-6 on
  # the state, gradients <= 6.7e-6 but dg 1.6e-5 and d dt_bias 3.3e-5;
  # HIGHEST on scores and state 5.1e-6 on the output, gradients <= 5.0e-6
  # (each the same to two digits with the other backward form).
  # (At T = 4096 and lower bounds -5, -1, -0.1 with a_log = -3, HIGH
  # everywhere kept 6.8e-6 on the output, d a_log up to 2.6e-4; any group
  # at one pass missed: 2.3e-4..3.6e-3 on the output.)
  (out, grads), (out64, grads64) = _raw_pair(
      1024, gated=True, l2norm=True, precision=precision,
      fused_backward=fused_backward)
  pairs = list(zip(("output", "final_state") + RAW_NAMES,
                   list(out) + list(grads), list(out64) + list(grads64)))
  for name, x, w in pairs:
    testing.assert_close(x, np.asarray(w), rtol=F32_OP_BOUNDS[name],
                         name=name)
  assert len(pairs) == len(F32_OP_BOUNDS)
