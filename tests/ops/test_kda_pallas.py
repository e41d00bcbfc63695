"""Our Pallas TPU KDA kernels (`ops/kda/pallas_tpu.py`).

Off a TPU in Pallas interpret mode; on a TPU the compiled kernel runs
(`INTERPRET`, `testing.pallas_interpret`: interpret mode there runs the
kernel's body as XLA ops at the chip's default precision), and the float64
oracles run on the host CPU.

Outputs and final states against the float64 NumPy recurrence, gradients
(the backward kernel) against the `reference` op in float64
(`tests/kda_oracle.py`) as relative L2 errors, on prepared inputs (q scaled
and normalised, k normalised, g the activated log decay in [-5, 0]); the
export for TPU v5e and v6e (`jax.export` inside `mosaic.lowering_mode`,
which lowers the kernel to Mosaic without a chip); and the limits, which
raise NotImplementedError. Measured here (CPU, interpret mode, B=1, H=2,
K=V=128): float32 inputs at HIGHEST 2e-7..3e-7 on the output and 5e-8..2e-7
on the state; bfloat16 q/k/v (output rounded to bfloat16) 1.7e-3 at HIGHEST
and 3.8e-3 at DEFAULT on the output. Interpret mode computes HIGH and
HIGHEST products as exact float32 (only DEFAULT's bfloat16 operands round
here), so these are not a chip's numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda import common
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import pallas_tpu
from linear_attention.ops.kda.precision import ACCURATE, FAST, Precisions
from tests.kda_oracle import kda_numpy

DEFAULT = jax.lax.Precision.DEFAULT
HIGHEST = jax.lax.Precision.HIGHEST
RTOL_F32 = 1e-5
# bfloat16 q, k, v: the output is bfloat16 (its rounding alone is ~2e-3);
# measured 1.7e-3 (HIGHEST) and 3.8e-3 (DEFAULT); the state stays float32.
RTOL_BF16_OUT = 6e-3
RTOL_BF16_STATE = {"highest": 1e-6, "default": 6e-3}  # measured 5e-8, 2.7e-3
# interpret= of every kernel call here and in test_kda_pallas_batched.py:
# interpret mode off a TPU, the compiled kernel on one.
INTERPRET = testing.pallas_interpret()


def prepared(t, *, h=2, kd=128, vd=128, seed=0, g=(-5.0, 0.0), beta=None,
             init=True, b=1):
  """Prepared inputs: unit q (times K^-1/2) and k, g uniform in g."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(b, t, h, kd))) * kd ** -0.5
  k = unit(rng.normal(size=(b, t, h, kd)))
  v = rng.normal(size=(b, t, h, vd))
  gv = rng.uniform(*g, (b, t, h, kd))
  bv = (rng.uniform(0.0, 1.0, (b, t, h)) if beta is None
        else np.full((b, t, h), beta))
  s0 = rng.normal(size=(b, h, kd, vd)) * 0.5 if init else None
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  return tuple(map(f32, (q, k, v, gv, bv, s0)))


def oracle(q, k, v, g, beta, s0):
  f64 = lambda x: None if x is None else np.asarray(
      jnp.asarray(x, jnp.float32), np.float64)
  return kda_numpy(*map(f64, (q, k, v, g, beta)), scale=1.0,
                   initial_state=f64(s0))


def run(args, **kw):
  kw.setdefault("precision", ACCURATE)
  o, state = pallas_tpu.kda_forward(*args, interpret=INTERPRET, **kw)
  assert state.dtype == jnp.float32 and o.dtype == args[0].dtype
  return o, state


@pytest.mark.parametrize("t, g, beta, init", [
    (64, (-5.0, 0.0), None, False),
    (100, (-5.0, 0.0), None, True),  # padded to 128: the state must not see it
    (192, (-5.0, -5.0), None, True),  # the extreme decay, every g at the limit
    (192, (-1e-3, 0.0), None, True),  # almost no decay: 192 tokens of state
    (100, (-1.0, 0.0), 1.0, True),
    (100, (-1e-3, 0.0), 0.0, True),  # no writes: the decayed initial state
])
def test_matches_the_float64_recurrence(t, g, beta, init):
  args = prepared(t, g=g, beta=beta, init=init)
  o, state = run(args)
  o_ref, s_ref = oracle(*args)
  assert o.shape == o_ref.shape and state.shape == s_ref.shape
  testing.assert_close(o, o_ref, rtol=RTOL_F32, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_F32, name="final_state")


@pytest.mark.parametrize("h, kd, vd, chunk, hb", [
    (4, 128, 128, 32, 2),  # two head blocks, a 32-token chunk
    (3, 256, 128, 128, None),  # K = 256, one 128-token chunk of two
    (2, 128, 256, 16, 1),  # V = 256, 16-token chunks (one block each)
])
def test_tilings(h, kd, vd, chunk, hb):
  args = prepared(200, h=h, kd=kd, vd=vd, seed=1)
  o, state = run(args, chunk=chunk, heads_per_block=hb)
  o_ref, s_ref = oracle(*args)
  testing.assert_close(o, o_ref, rtol=RTOL_F32, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_F32, name="final_state")


def test_on_the_ops_prepared_inputs_under_jit():
  # Raw op inputs through `common.prepare` (lower-bound gate at -5, q/k L2
  # norm, scale), the kernel under jit (g traced: only lower_bound checked).
  rng = np.random.default_rng(2)
  b, t, h, kd = 1, 130, 2, 128
  raw = dict(q=rng.normal(size=(b, t, h, kd)), k=rng.normal(size=(b, t, h, kd)),
             v=rng.normal(size=(b, t, h, kd)),
             g=rng.normal(size=(b, t, h, kd)) * 2.0,
             beta=rng.uniform(0.05, 1.0, (b, t, h)))
  raw = {n: jnp.asarray(x, jnp.float32) for n, x in raw.items()}
  gate = dict(a_log=jnp.log(jnp.asarray([2.0, 9.0])),
              dt_bias=jnp.asarray(rng.normal(size=h * kd) * 0.5, jnp.float32))
  init = jnp.asarray(rng.normal(size=(b, h, kd, kd)) * 0.5, jnp.float32)
  scale = kd ** -0.5

  @jax.jit
  def f(q, k, v, g, beta, init):
    cn = common.prepare(q, k, v, g, beta, scale=scale, lower_bound=-5.0,
                        use_gate_in_kernel=True, use_qk_l2norm=True,
                        initial_state=None, segment_ids=None,
                        max_num_segments=None, **gate)
    return pallas_tpu.kda_forward(cn.q, cn.k, cn.v, cn.g, cn.beta, init,
                                  precision=ACCURATE, lower_bound=-5.0,
                                  interpret=INTERPRET)

  o, state = f(*raw.values(), init)
  o_ref, s_ref = kda_numpy(*raw.values(), scale=scale, lower_bound=-5.0,
                           use_gate_in_kernel=True, use_qk_l2norm=True,
                           initial_state=init, **gate)
  testing.assert_close(o, o_ref, rtol=RTOL_F32, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_F32, name="final_state")


@pytest.mark.parametrize("name, precision", [("highest", ACCURATE),
                                             ("default", FAST)])
def test_bfloat16_inputs(name, precision):
  q, k, v, g, beta, s0 = prepared(100, seed=3)
  args = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
          v.astype(jnp.bfloat16), g, beta.astype(jnp.bfloat16), s0)
  o, state = run(args, precision=precision)
  o_ref, s_ref = oracle(*args)  # the recurrence on the rounded inputs
  testing.assert_close(o, o_ref, rtol=RTOL_BF16_OUT, name="output")
  testing.assert_close(state, s_ref, rtol=RTOL_BF16_STATE[name],
                       name="final_state")


def _grads_pair(args, cotangent_seed=3, forward=pallas_tpu.kda_forward, **kw):
  """The kernel's VJP and the float64 `reference` op's, same cotangents."""
  rng = np.random.default_rng(cotangent_seed)
  do = rng.normal(size=args[2].shape)
  ds = rng.normal(size=(args[0].shape[0], args[0].shape[2], args[0].shape[3],
                        args[2].shape[3]))
  kw.setdefault("precision", ACCURATE)
  nargs = 6 if args[5] is not None else 5

  def vjp(f, xs):
    out, back = jax.vjp(f, *xs[:nargs])
    return out, back((jnp.asarray(do, out[0].dtype),
                      jnp.asarray(ds, out[1].dtype)))

  kernel = lambda *xs: forward(*xs, interpret=INTERPRET, **kw)
  got = vjp(kernel, args)
  with testing.float64_on_host():
    a64 = [None if x is None else jnp.asarray(np.asarray(
        jnp.asarray(x, jnp.float32), np.float64)) for x in args]

    def reference(q, k, v, g, beta, s0=None):
      return ops.kimi_delta_attention(
          q, k, v, g, beta, scale=1.0, initial_state=s0,
          output_final_state=True, backend="reference", precision="highest")
    want = vjp(reference, a64)
  return got, want


@pytest.mark.parametrize("t, g, beta, init, chunk", [
    (100, (-5.0, 0.0), None, True, 64),  # padded; an initial state
    (192, (-5.0, -5.0), None, False, 64),  # every g at the limit
    (160, (-1e-3, 0.0), None, True, 32),  # almost no decay, 32-token chunks
    (100, (-1.0, 0.0), 1.0, True, 64),  # beta = 1
])
def test_gradients_match_the_float64_reference(t, g, beta, init, chunk):
  # The reference token scan in float64 (its gradients are anchored by
  # float64 finite differences, tests/ops/test_gradient_anchors.py).
  args = prepared(t, g=g, beta=beta, init=init, seed=6)
  (out, grads), (out64, grads64) = _grads_pair(args, chunk=chunk)
  for name, x, w in zip(("output", "final_state"), out, out64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)
  names = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
  for name, x, w in zip(names, grads, grads64):
    assert x.dtype == jnp.float32, name
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


def test_gradients_with_two_batch_rows_two_head_blocks_and_long_chunks():
  # B = 2 and two head blocks: every index map's batch and head-block parts.
  args = prepared(200, h=4, b=2, seed=8)
  (_, grads), (_, grads64) = _grads_pair(args, chunk=128, heads_per_block=2)
  for name, x, w in zip(("dq", "dk", "dv", "dg", "dbeta", "ds0"), grads,
                        grads64):
    testing.assert_close(x, np.asarray(w), rtol=RTOL_F32, name=name)


def test_gradients_of_bfloat16_inputs_and_two_head_blocks():
  q, k, v, g, beta, s0 = prepared(100, h=4, seed=7)
  bf = lambda x: x.astype(jnp.bfloat16)
  args = (bf(q), bf(k), bf(v), g, bf(beta), s0)
  (_, grads), (_, grads64) = _grads_pair(args, precision=FAST,
                                         heads_per_block=2)
  dtypes = (jnp.bfloat16,) * 3 + (jnp.float32, jnp.bfloat16, jnp.float32)
  for name, x, w, dtype in zip(("dq", "dk", "dv", "dg", "dbeta", "ds0"),
                               grads, grads64, dtypes):
    assert x.dtype == dtype, name
    # One bfloat16 pass and gradients rounded to bfloat16: measured
    # 2.4e-3..4.0e-3 (CPU, interpret mode); the bound is twice the largest.
    testing.assert_close(x, np.asarray(w), rtol=8e-3, name=name)


def test_each_precision_group_is_its_own():
  # One group at DEFAULT (bfloat16 operands) and the rest at HIGHEST: the
  # error rises above float32's, so each group reaches its own matmuls.
  args = prepared(100, seed=4)
  o_ref, s_ref = oracle(*args)
  for i, group in enumerate(Precisions._fields):
    p = Precisions(*[DEFAULT if j == i else HIGHEST for j in range(4)])
    o, state = run(args, precision=p)
    err = max(testing.relative_l2_error(o, o_ref),
              testing.relative_l2_error(state, s_ref))
    assert 1e-5 < err < 1e-2, (group, err)


def test_exponent_factors_are_exact_and_bounded():
  # Row + column exponent = G_i - G_j for every causal pair; the factors of
  # the row's own block within [-40, 40], earlier blocks' <= 0 (g = -5).
  c = 64
  e = pallas_tpu.exponent_matrix(c).astype(np.float64)
  assert e.shape == ((3 + c // 16) * c + 8, c)
  assert set(np.unique(e)) <= {-1.0, -0.5, 0.0, 0.5, 1.0}  # exact in bf16
  for g in (np.full((c, 1), -5.0), np.random.default_rng(5).uniform(
      -5, 0, (c, 3))):
    x = e @ g
    G = np.cumsum(g, axis=0)
    np.testing.assert_allclose(x[:c], G)
    np.testing.assert_allclose(x[c:2 * c], G[-1] - G, atol=1e-12)
    np.testing.assert_allclose(x[-8:], np.broadcast_to(G[-1], (8, g.shape[1])))
    for n in range(c // 16):
      rows = x[2 * c + 16 * n:2 * c + 16 * (n + 1)]
      cols = x[(3 + n) * c:(4 + n) * c]
      assert np.abs(rows).max() <= 40 + 1e-9
      assert np.abs(cols[16 * n:16 * (n + 1)]).max() <= 40 + 1e-9
      assert cols[:16 * n].max(initial=0.0) <= 1e-9
      for i in range(16 * n, 16 * (n + 1)):
        np.testing.assert_allclose(rows[i - 16 * n] + cols[:i + 1],
                                   G[i] - G[:i + 1], atol=1e-9)


def test_budget_fits_v5e_scoped_vmem():
  # The default tiling (4 heads, K = V = 128, C = 64, float32) in the 16 MiB
  # scoped VMEM v5e gives a kernel by default (docs/kernel.md).
  t = pallas_tpu.Tiles(chunk=64, heads_per_block=4, key_dim=128,
                       value_dim=128, has_initial_state=True,
                       precision=ACCURATE, interpret=False)
  assert pallas_tpu.vmem_bytes(t, jnp.float32, jnp.float32) < 16 * 2 ** 20
  assert pallas_tpu.flops_per_chunk(64, 128, 128) == 23_724_032


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exports_to_mosaic_for_tpu(chip, dtype):
  b, t, h, kd = 1, 256, 8, 128
  s = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  args = (s(b, t, h, kd), s(b, t, h, kd), s(b, t, h, kd),
          s(b, t, h, kd, d=jnp.float32), s(b, t, h, d=jnp.float32),
          s(b, h, kd, kd, d=jnp.float32))
  precision = ACCURATE if dtype == jnp.float32 else FAST
  f = jax.jit(lambda *a: pallas_tpu.kda_forward(*a, precision=precision,
                                                lower_bound=-5.0))
  with mosaic.lowering_mode(chip):
    exported = jax.export.export(f, platforms=["tpu"])(*args)
  assert exported.platforms == ("tpu",)
  assert exported.mlir_module().count("tpu_custom_call") == 1
  assert [a.shape for a in exported.out_avals] == [(b, t, h, kd),
                                                   (b, h, kd, kd)]


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_backward_exports_to_mosaic_for_tpu(chip):
  b, t, h, kd = 1, 256, 8, 128
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  args = (s(b, t, h, kd), s(b, t, h, kd), s(b, t, h, kd), s(b, t, h, kd),
          s(b, t, h), s(b, h, kd, kd))

  def loss(*a):
    o, state = pallas_tpu.kda_forward(*a, precision=ACCURATE,
                                      lower_bound=-5.0)
    return jnp.sum(o * o) + jnp.sum(state)

  f = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
  with mosaic.lowering_mode(chip):
    exported = jax.export.export(f, platforms=["tpu"])(*args)
  # The forward saving its chunk states, then the backward.
  assert exported.mlir_module().count("tpu_custom_call") == 2
  assert [a.shape for a in exported.out_avals] == [x.shape for x in args]


def test_limits_raise():
  q, k, v, g, beta, s0 = prepared(64)
  call = lambda *a, **kw: pallas_tpu.kda_forward(
      *a, **{"precision": ACCURATE, "interpret": INTERPRET, **kw})
  args = (q, k, v, g, beta, s0)
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match="interpret=True"):
      call(*args, interpret=False)
  with pytest.raises(NotImplementedError, match="segment_ids"):
    call(*args, segment_ids=jnp.ones((1, 64), jnp.int32))
  with pytest.raises(NotImplementedError, match="multiples of 128"):
    call(q[..., :64], k[..., :64], v, g[..., :64], beta, s0[:, :, :64])
  with pytest.raises(NotImplementedError, match="multiples of 128"):
    call(q, k, v[..., :96], g, beta, s0[..., :96])
  for chunk in (40, 8, 256):
    with pytest.raises(NotImplementedError, match="chunk"):
      call(*args, chunk=chunk)
  with pytest.raises(NotImplementedError, match="lower_bound=-6"):
    call(*args, lower_bound=-6.0)
  with pytest.raises(NotImplementedError, match="heads_per_block"):
    call(*args, heads_per_block=3)
  half = lambda x: x.astype(jnp.float16)
  with pytest.raises(NotImplementedError, match="float32 or bfloat16"):
    call(half(q), half(k), half(v), g, beta, s0)
  with pytest.raises(NotImplementedError, match="one dtype"):
    call(q, k, v.astype(jnp.bfloat16), g, beta, s0)
  with pytest.raises(ValueError, match="smallest"):
    call(q, k, v, g.at[0, 3, 1, 7].set(-5.5), beta, s0)
  with pytest.raises(ValueError, match="Precisions"):
    call(*args, precision="highest")

