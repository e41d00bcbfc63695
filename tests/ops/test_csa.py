"""CSA indexer score: every backend against a float64 NumPy oracle.

The oracle below is written from the formulas (DeepSeek-V4 inference code,
MaxText `csa_streamindex.py`), not from the library: forward, and the three
gradients under a random cotangent G (masked entries zeroed):
dweights = c sum_w G relu(A); dA = c G weights 1[A > 0]; dq = sum_w dA k;
dk = sum_{h,s} dA q. Masked cotangent entries are NaN in every gradient
test, so a leak shows up as NaN. Errors are relative L2 (f32: <= 1e-5).
"""

import contextlib
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.csa import pallas
from linear_attention.ops.kda import mosaic
from tests import devices as test_devices

F32_RTOL = testing.RTOL[np.dtype("float32")]
BF16_RTOL = testing.RTOL[np.dtype("bfloat16")]


def oracle(q, k, w, *, scale, qpos, kpos, qseg=None, kseg=None, g=None):
  """float64 forward [B,S,W] (and dq, dk, dw for cotangent g)."""
  q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
  a = np.einsum("bshd,bwd->bshw", q, k)
  relu = np.maximum(a, 0.0)
  mask = np.asarray(kpos)[:, None, :] <= np.asarray(qpos)[:, :, None]
  if qseg is not None:
    mask &= np.asarray(qseg)[:, :, None] == np.asarray(kseg)[:, None, :]
  out = np.where(mask, scale * np.einsum("bsh,bshw->bsw", w, relu), -np.inf)
  if g is None:
    return out, mask
  gm = np.where(mask, np.asarray(g, np.float64), 0.0) * scale
  dw = np.einsum("bsw,bshw->bsh", gm, relu)
  da = gm[:, :, None, :] * w[..., None] * (a > 0)
  dq = np.einsum("bshw,bwd->bshd", da, k)
  dk = np.einsum("bshw,bshd->bwd", da, q)
  return out, mask, (dq, dk, dw)


@dataclasses.dataclass(frozen=True)
class Case:
  b: int = 2
  s: int = 37
  h: int = 3
  d: int = 16
  w: int = 11
  r: int = 3
  positions: str = "default"  # "default" | "custom" | "packed"
  dtype: str = "float32"
  seed: int = 0


def make(c: Case):
  """Inputs and the op's position / segment keyword arguments."""
  rng = np.random.default_rng(c.seed)
  q = rng.normal(size=(c.b, c.s, c.h, c.d)).astype(np.float32)
  k = rng.normal(size=(c.b, c.w, c.d)).astype(np.float32)
  w = rng.normal(size=(c.b, c.s, c.h)).astype(np.float32)
  kw = {}
  if c.positions == "default":
    qpos = np.broadcast_to(np.arange(c.s), (c.b, c.s))
    kpos = np.broadcast_to((np.arange(c.w) + 1) * c.r - 1, (c.b, c.w))
  elif c.positions == "custom":
    qpos = np.sort(rng.integers(0, c.w * c.r + 5, (c.b, c.s)), axis=1)
    kpos = np.sort(rng.integers(0, c.w * c.r, (c.b, c.w)), axis=1)
    kw.update(q_positions=jnp.asarray(qpos, jnp.int32),
              block_last_positions=jnp.asarray(kpos, jnp.int32))
  else:  # packed documents: positions restart in each, blocks per document
    qpos, qseg = np.zeros((c.b, c.s), int), np.zeros((c.b, c.s), int)
    kpos, kseg = np.zeros((c.b, c.w), int), np.zeros((c.b, c.w), int)
    for row in range(c.b):
      cuts = np.sort(rng.choice(np.arange(1, c.s), 2, replace=False))
      edges = [0, *cuts, c.s]
      kcuts = np.sort(rng.choice(np.arange(1, c.w), 2, replace=False))
      kedges = [0, *kcuts, c.w]
      for n in range(3):
        qpos[row, edges[n]:edges[n + 1]] = np.arange(edges[n + 1] - edges[n])
        qseg[row, edges[n]:edges[n + 1]] = n + 1
        nb = kedges[n + 1] - kedges[n]
        kpos[row, kedges[n]:kedges[n + 1]] = (np.arange(nb) + 1) * c.r - 1
        kseg[row, kedges[n]:kedges[n + 1]] = n + 1
    kw.update(q_positions=jnp.asarray(qpos, jnp.int32),
              block_last_positions=jnp.asarray(kpos, jnp.int32),
              q_segment_ids=jnp.asarray(qseg, jnp.int32),
              kv_segment_ids=jnp.asarray(kseg, jnp.int32))
  dt = jnp.dtype(c.dtype)
  q, k, w = (jnp.asarray(x, dt) for x in (q, k, w))
  scale = c.d ** -0.5
  orc = dict(scale=scale, qpos=qpos, kpos=kpos, qseg=kw.get("q_segment_ids"),
             kseg=kw.get("kv_segment_ids"))
  return (q, k, w), dict(softmax_scale=scale, compress_rate=c.r, **kw), orc


def cotangent(c: Case, mask):
  rng = np.random.default_rng(c.seed + 1)
  g = rng.normal(size=mask.shape).astype(np.float32)
  return np.where(mask, g, np.nan).astype(np.float32)  # NaN must not leak


def check_forward(out, expected, mask, rtol, name="score"):
  out = np.asarray(out)
  assert out.dtype == np.float32
  # exact: every backend writes -inf with jnp.where on the integer mask.
  np.testing.assert_array_equal(np.isneginf(out), ~mask,
                                err_msg=f"{name}: -inf pattern")
  if mask.any():
    testing.assert_close(out[mask], expected[mask], rtol=rtol, name=name)
  return testing.relative_l2_error(out[mask], expected[mask])


def float32_score_bound(q, k, w, scale):
  """[B, S, W] bound on |a - b| for two float32 evaluations of the score.

  A float32 sum of n terms, in any order, errs by <= n * eps * sum|terms|;
  relu is 1-Lipschitz. So c sum_h w_h relu(sum_d q_hd k_d) errs by
  <= (d + h + 2) eps M with M = c sum_h |w_h| sum_d |q_hd| |k_d| (d products
  summed, h products summed, one scale), and two evaluations by twice that.
  """
  q, k, w = (np.abs(np.asarray(x, np.float64)) for x in (q, k, w))
  h, d = q.shape[-2:]
  m = scale * np.einsum("bsh,bshd,bwd->bsw", w, q, k)
  return 2 * (d + h + 2) * np.finfo(np.float32).eps * m


def run_vjp(c: Case, backend, **tiles):
  """Forward and (dq, dk, dw) of one backend vs the oracle; returns errors."""
  (q, k, w), kw, orc = make(c)
  expected, mask = oracle(q, k, w, **orc)
  g = cotangent(c, mask)
  _, _, grads = oracle(q, k, w, g=g, **orc)
  f = lambda q, k, w: ops.csa_streamindex_score(q, k, w, backend=backend,
                                                **tiles, **kw)
  out, vjp = jax.vjp(jax.jit(f), q, k, w)
  rtol = F32_RTOL if c.dtype == "float32" else BF16_RTOL
  errs = [check_forward(out, expected, mask, rtol)]
  for name, got, want in zip(("dq", "dk", "dweights"), vjp(jnp.asarray(g)),
                             grads):
    assert got.dtype == jnp.dtype(c.dtype)
    testing.assert_close(got, want, rtol=rtol, name=f"{backend} {name}")
    errs.append(testing.relative_l2_error(got, want))
  return errs


CASES = {
    "basic": Case(),
    "custom_positions": Case(positions="custom", seed=1),
    "packed": Case(positions="packed", s=29, w=9, seed=2),
    "s_lt_block": Case(b=1, s=5, w=3, r=2, seed=3),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend,tiles", [
    ("reference", {}),
    ("xla_chunked", {}),
    ("xla_chunked", dict(block_q=8, head_chunk=1)),
])
def test_xla_backends_match_oracle(name, backend, tiles):
  run_vjp(CASES[name], backend, **tiles)


@pytest.mark.parametrize("name,tiles", [
    ("basic", dict(block_q=16, head_chunk=1)),  # S=37 -> 3 tiles, padded
    ("packed", dict(block_q=8)),                 # segments, heads stacked
    ("s_lt_block", {}),                          # S=5 < default block_q
])
def test_pallas_interpret_matches_oracle(name, tiles):
  run_vjp(CASES[name], "pallas", interpret=True, **tiles)


def test_pallas_w_tiles_padded_and_skipped():
  # W=130 > block_w=128: two W tiles, the second padded; custom positions
  # leave whole (query tile, block tile) pairs invisible, which are skipped.
  c = Case(b=1, s=20, h=2, d=8, w=130, r=2, positions="custom", seed=4)
  run_vjp(c, "pallas", interpret=True, block_q=8, block_w=128)


@pytest.mark.parametrize("backend,tiles", [
    ("xla_chunked", dict(block_q=4)), ("pallas", dict(interpret=True))])
def test_bf16(backend, tiles):
  # bf16 operands, f32 accumulation: oracle on the bf16-rounded inputs.
  run_vjp(Case(b=1, s=12, h=2, d=16, w=5, r=2, dtype="bfloat16", seed=5),
          backend, **tiles)


@pytest.mark.parametrize("backend,tiles", [
    ("reference", {}), ("xla_chunked", dict(block_q=4)),
    ("pallas", dict(block_q=8, interpret=True))])
def test_rows_without_visible_block(backend, tiles):
  # r=4: queries 0..2 see no block; their row is -inf with zero gradient.
  c = Case(b=1, s=11, h=2, d=8, w=2, r=4, seed=6)
  (q, k, w), kw, orc = make(c)
  _, mask = oracle(q, k, w, **orc)
  assert not mask[0, :3].any() and mask[0, 3:].any()
  f = lambda q, k, w: ops.csa_streamindex_score(q, k, w, backend=backend,
                                                **tiles, **kw)
  out, vjp = jax.vjp(jax.jit(f), q, k, w)
  assert np.all(np.isneginf(np.asarray(out)[0, :3]))
  dq, dk, dw = vjp(jnp.asarray(cotangent(c, mask)))
  for x in (dq, dk, dw):
    assert np.all(np.isfinite(np.asarray(x)))
  # exact: the backward zeroes the masked cotangent with jnp.where.
  assert not np.any(np.asarray(dq)[0, :3]) and not np.any(np.asarray(dw)[0, :3])
  # A batch where nothing is visible at all: every gradient exactly zero.
  g = jnp.asarray(np.random.default_rng(0).normal(size=out.shape), jnp.float32)
  _, vjp0 = jax.vjp(jax.jit(lambda q, k, w: f(q[:, :3], k, w[:, :3])), q, k,
                    w)
  for x in vjp0(g[:, :3]):  # exact: a jnp.where zeroes every cotangent
    assert not np.any(np.asarray(x))


class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_xla_chunked_forward(self):
    (q, k, w), kw, orc = make(Case(positions="packed", s=29, w=9, seed=7))
    expected, mask = oracle(q, k, w, **orc)
    f = self.variant(lambda q, k, w: ops.csa_streamindex_score(
        q, k, w, backend="xla_chunked", block_q=8, **kw))
    check_forward(f(q, k, w), expected, mask, F32_RTOL)


def test_sharded_matches_unsharded():
  devices = np.array(test_devices.devices(8))
  mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "context"))
  c = Case(b=4, s=13, h=2, d=8, w=6, r=2, positions="packed", seed=8)
  (q, k, w), kw, orc = make(c)
  expected, mask = oracle(q, k, w, **orc)
  for backend, tiles in (("xla_chunked", dict(block_q=8)),
                         ("pallas", dict(interpret=True))):
    want = ops.csa_streamindex_score(q, k, w, backend=backend, **tiles, **kw)
    got = jax.jit(lambda q, k, w: ops.csa_streamindex_score_sharded(
        mesh, "data", q, k, w, backend=backend, **tiles, **kw))(q, k, w)
    assert got.sharding.spec[0] in ("data", ("data",))
    # Two compiled programs: equal to float32 rounding (the bound's
    # derivation is in float32_score_bound), not bit for bit.
    got_np, want_np = np.asarray(got), np.asarray(want)
    # exact: both write -inf with jnp.where on the same integer mask.
    np.testing.assert_array_equal(np.isneginf(got_np), np.isneginf(want_np))
    live = np.isfinite(want_np)
    err = np.abs(got_np[live].astype(np.float64) - want_np[live])
    bound = float32_score_bound(q, k, w, orc["scale"])[live]
    assert np.all(err <= bound), (backend, (err / bound).max())
    check_forward(got, expected, mask, F32_RTOL, name=f"sharded {backend}")
  with pytest.raises(ValueError, match="data_axes"):
    ops.csa_streamindex_score_sharded(mesh, "model", q, k, w, **kw)
  with pytest.raises(ValueError, match="divisible"):
    ops.csa_streamindex_score_sharded(mesh, ("data", "context"), q, k, w,
                                      **kw)


def test_bad_inputs_raise_naming_the_argument():
  (q, k, w), kw, _ = make(Case(b=1, s=8, h=2, d=4, w=3, r=2))
  call = lambda **over: ops.csa_streamindex_score(
      **{"q": q, "k_compressed": k, "weights": w, **kw, **over})
  bad = {
      "q": dict(q=q[0]),
      "k_compressed": dict(k_compressed=k[..., :3]),
      "weights": dict(weights=w[:, :, :1]),
      "compress_rate": dict(compress_rate=0),
      "softmax_scale": dict(softmax_scale=float("nan")),
      "q_positions": dict(q_positions=jnp.zeros((1, 7), jnp.int32)),
      "block_last_positions": dict(
          block_last_positions=jnp.zeros((1, 3), jnp.float32)),
      "kv_segment_ids": dict(q_segment_ids=jnp.zeros((1, 8), jnp.int32)),
      "backend": dict(backend="cuda"),
      "interpret": dict(interpret=True),
      "block_w": dict(backend="xla_chunked", block_w=128),
      "block_q": dict(backend="pallas", block_q=0),
  }
  for name, over in bad.items():
    with pytest.raises(ValueError, match=name):
      call(**over)
  with pytest.raises(NotImplementedError, match="block_w"):
    call(k_compressed=jnp.zeros((1, 200, 4)), block_last_positions=None,
         backend="pallas", block_w=100)
  with pytest.raises(NotImplementedError, match="block_q"):
    call(backend="pallas", block_q=4, block_w=None, interpret=True)
  with pytest.raises(NotImplementedError, match="head_chunk"):
    call(backend="pallas", head_chunk=3)
  with pytest.raises(NotImplementedError, match="head_chunk"):
    call(backend="xla_chunked", head_chunk=3)
  if jax.default_backend() != "tpu":  # no silent switch to interpret mode
    with pytest.raises(NotImplementedError, match="interpret=True"):
      call(backend="pallas")


@pytest.mark.parametrize("dtype,interpret", [("float32", False),
                                              ("bfloat16", False),
                                              ("float32", None)])
def test_pallas_kernels_lower_to_mosaic(dtype, interpret):
  # No TPU here: export for the TPU platform runs the Pallas -> Mosaic
  # lowering of all three kernels (block shapes, in-kernel ops), not libtpu.
  # interpret=None (the default: Mosaic on TPU) lowers inside
  # mosaic.lowering_mode, where the target device is a TPU.
  dt = jnp.dtype(dtype)
  b, s, h, d, w = 2, 300, 4, 64, 200
  shapes = [jax.ShapeDtypeStruct((b, s, h, d), dt),
            jax.ShapeDtypeStruct((b, w, d), dt),
            jax.ShapeDtypeStruct((b, s, h), dt),
            jax.ShapeDtypeStruct((b, s), jnp.int32),
            jax.ShapeDtypeStruct((b, w), jnp.int32)]

  def f(q, k, wt, qseg, kseg):
    score = lambda q, k, wt: ops.csa_streamindex_score(
        q, k, wt, softmax_scale=0.125, compress_rate=2, q_segment_ids=qseg,
        kv_segment_ids=kseg, backend="pallas", interpret=interpret, block_q=128,
        block_w=128, head_chunk=2)
    out, vjp = jax.vjp(score, q, k, wt)
    return out, vjp(jnp.zeros_like(out))

  with (mosaic.lowering_mode("v6e") if interpret is None
        else contextlib.nullcontext()):
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)
  assert exported.mlir_module().count("tpu_custom_call") == 3


@pytest.mark.parametrize("positions", ["default", "packed"])
def test_pallas_tile_skipping_is_safe_and_skips(positions):
  # Every tile holding a visible entry must be computed; some must be skipped.
  c = Case(b=2, s=64, w=32, r=2, positions=positions, seed=9)
  _, kw, orc = make(c)
  _, mask = oracle(np.zeros((c.b, c.s, 1, 1)), np.zeros((c.b, c.w, 1)),
                   np.zeros((c.b, c.s, 1)), **orc)
  seg = lambda x, n: np.zeros(n, np.int32) if x is None else np.asarray(x)
  live = np.asarray(pallas.live_tiles(
      jnp.asarray(orc["qpos"]), jnp.asarray(orc["kpos"]),
      jnp.asarray(seg(orc["qseg"], (c.b, c.s))),
      jnp.asarray(seg(orc["kseg"], (c.b, c.w))), 8, 8))
  any_visible = mask.reshape(c.b, 8, 8, 4, 8).any(axis=(2, 4))
  assert live.shape == any_visible.shape
  assert np.all(live | ~any_visible)
  assert (~live).sum() >= 20, (~live).sum()
