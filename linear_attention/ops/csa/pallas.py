"""Fused Pallas (TPU-style) kernels for the CSA indexer score, fwd and bwd.

Math (DeepSeek-V4 inference code `Indexer`; MaxText
`kernels/attention/csa_streamindex.py`), c = softmax_scale,
A[b, s, h, w] = q[b, s, h, :] . k[b, w, :]:

    score    = c sum_h weights relu(A)                (masked entries: -inf)
    dweights = c sum_w G relu(A)
    dA       = c G weights 1[A > 0]
    dq       = sum_w dA k
    dk       = sum_{h, s} dA q

where G = dL/dscore with masked entries set to zero (`where`, so a
non-finite cotangent there cannot leak).

Layout and tiles. Outside the kernels q becomes [B, H, S, D] and weights
[B, H, S, 1] (one transpose each), positions and segment ids become a
[B, S, 1] column and a [B, 1, W] row, so that every block's last two dims
are (multiple of 8 or full, multiple of 128 or full) as Mosaic requires; the
batch block is 1. S is padded to a multiple of `block_q` and W to a multiple
of `block_w` (padded queries get position int32 min, padded blocks int32
max: never visible, and sliced off). Heads are stacked in on-chip memory in
chunks of `head_chunk` ([head_chunk, block_q, D] per q block).

    forward  grid (B, S/bq, W/bw, H/hc)   out tile [bq, bw] f32 accumulates over
             the head-chunk axis; mask and scale at the last chunk.
    dq, dw   grid (B, S/bq, H/hc, W/bw)   dq [hc, bq, D], dw [hc, bq, 1] f32
             accumulate over W tiles (innermost).
    dk       grid (B, W/bw, S/bq, H/hc)   dk [bw, D] f32 accumulates over S
             tiles and head chunks.

Every kernel recomputes A = q_h k^T for its tile, head by head; nothing of
size [B, H, S, W] (or even [B, S, W] per head) is stored. A tile that no
query can see is skipped with `pl.when`: per tile, scalar-prefetched
statistics (the largest query position and the smallest block position, and
the segment-id ranges) prove that every entry is masked. The forward still
writes -inf there.

Dtypes: matmul operands keep the input dtype (bf16 inputs give bf16 MXU
matmuls; dA is cast to bf16 for the backward matmuls) and accumulate in
float32, at the call's precision (HIGHEST for float32 inputs at "auto", the
exact path the tests check). Weights enter the kernels as float32; scores, dq/dk accumulation and
dweights are float32 throughout.

On TPU the kernels compile with Mosaic; elsewhere `interpret=True` runs the
same kernels in Pallas interpret mode (slow: tests only). Off TPU without it
`supports` refuses the call (the op raises `NotImplementedError`), the rule
of KDA's `tokamax` backend: a Pallas backend never switches to interpret
mode by itself.
"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from linear_attention.ops import backends
from linear_attention.ops.csa import common

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_W = 512
MAX_DEFAULT_HEAD_CHUNK = 16

_F32 = jnp.float32
_IMIN = np.iinfo(np.int32).min
_IMAX = np.iinfo(np.int32).max
_NT = (((1,), (1,)), ((), ()))  # a @ b.T

NAME = "pallas"
OPTIONS = ("block_q", "block_w", "head_chunk", "interpret")
NEEDS_TPU = True  # off TPU: only with interpret=True


def supports_target(target: backends.Target) -> str | None:
  if target.platform == "tpu":
    return None
  return ("it compiles its kernels with Mosaic, which needs a TPU; the"
          f" default device is {target.device_kind}. Pass interpret=True to"
          " run them in Pallas interpret mode (slow), or use"
          " backend='xla_chunked'.")


def supports(call: common.Call) -> str | None:
  """Why the kernels cannot take `call` (a tile rule, no TPU), or None."""
  (_, s, h, _), w = call.q.shape, call.k_compressed.shape[1]
  tiles = {n: call.options.get(n) for n in ("block_q", "block_w",
                                            "head_chunk")}
  try:
    resolve_tiles(s, w, h, **tiles)
  except NotImplementedError as e:
    return str(e)
  if call.options.get("interpret") is not None:
    return None  # asked for: interpret mode, or Mosaic (e.g. to export)
  return supports_target(call.target)


def run(call: common.Call):
  return call.run(score_pallas)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Static kernel configuration (hashable: a `custom_vjp` nondiff arg)."""

  scale: float
  block_q: int
  block_w: int
  head_chunk: int
  interpret: bool
  precision: jax.lax.Precision  # of every matmul in the kernels


def resolve_tiles(s, w, h, *, block_q=None, block_w=None, head_chunk=None):
  """Returns legal (block_q, block_w, head_chunk) for S, W, H.

  A tile at least as large as its dimension becomes the (padded-to-8 or
  full) dimension itself; otherwise block_q must be a multiple of 8 and
  block_w a multiple of 128 (TPU (8, 128) tiling).

  Raises:
    NotImplementedError: a tile breaks the TPU block-shape rule, or
      head_chunk does not divide H.
  """
  bq = block_q or DEFAULT_BLOCK_Q
  bw = block_w or DEFAULT_BLOCK_W
  if bq >= s:
    bq = s
  elif bq % 8:
    raise NotImplementedError(
        f"pallas needs block_q % 8 == 0 when block_q < S; got block_q={bq}.")
  if bw >= w:
    bw = w
  elif bw % 128:
    raise NotImplementedError(
        f"pallas needs block_w % 128 == 0 when block_w < W; got"
        f" block_w={bw}.")
  if head_chunk is None:
    head_chunk = max(c for c in range(1, min(h, MAX_DEFAULT_HEAD_CHUNK) + 1)
                     if h % c == 0)
  if h % head_chunk:
    raise NotImplementedError(
        f"pallas needs head_chunk to divide H; got head_chunk={head_chunk},"
        f" H={h}.")
  return bq, bw, head_chunk


# ------------------------------------------------------------------ kernels


def _live(qmeta_ref, kmeta_ref, b, i, j, nq, nk):
  """Whether tile (i, j) may hold a visible entry (scalar SMEM test)."""
  qi, kj = 3 * (b * nq + i), 3 * (b * nk + j)
  return ((kmeta_ref[kj] <= qmeta_ref[qi])            # min blk pos <= max q pos
          & (kmeta_ref[kj + 1] <= qmeta_ref[qi + 2])  # segment ranges overlap
          & (qmeta_ref[qi + 1] <= kmeta_ref[kj + 2]))


def _mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref):
  """[bq, bw] visibility from a position/segment column and row."""
  return ((kpos_ref[0] <= qpos_ref[0]) & (qseg_ref[0] == kseg_ref[0]))


def _fwd_kernel(qmeta_ref, kmeta_ref, q_ref, k_ref, w_ref, qpos_ref, kpos_ref,
                qseg_ref, kseg_ref, o_ref, *, t: Tiles, nq, nk, precision):
  b, i, j, c = (pl.program_id(a) for a in range(4))

  @pl.when(c == 0)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, _F32)

  @pl.when(_live(qmeta_ref, kmeta_ref, b, i, j, nq, nk))
  def _():
    k = k_ref[0]

    def head(h, acc):
      a = jax.lax.dot_general(q_ref[0, h], k, _NT, precision=precision,
                              preferred_element_type=_F32)
      return acc + w_ref[0, h].astype(_F32) * jnp.maximum(a, 0.0)

    o_ref[0] += jax.lax.fori_loop(0, t.head_chunk, head,
                                  jnp.zeros(o_ref.shape[1:], _F32))

  @pl.when(c == pl.num_programs(3) - 1)
  def _():
    mask = _mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref)
    o_ref[0] = jnp.where(mask, t.scale * o_ref[0], -jnp.inf)


def _dq_kernel(qmeta_ref, kmeta_ref, q_ref, k_ref, w_ref, g_ref, qpos_ref,
               kpos_ref, qseg_ref, kseg_ref, dq_ref, dw_ref, *, t: Tiles, nq,
               nk, precision):
  b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_ref[...] = jnp.zeros(dq_ref.shape, _F32)
    dw_ref[...] = jnp.zeros(dw_ref.shape, _F32)

  @pl.when(_live(qmeta_ref, kmeta_ref, b, i, j, nq, nk))
  def _():
    mask = _mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref)
    g = jnp.where(mask, g_ref[0], 0.0) * t.scale  # [bq, bw]
    k = k_ref[0]

    def head(h, carry):
      a = jax.lax.dot_general(q_ref[0, h], k, _NT, precision=precision,
                              preferred_element_type=_F32)
      dw_ref[0, h] += jnp.sum(g * jnp.maximum(a, 0.0), axis=1, keepdims=True)
      da = jnp.where(a > 0, g * w_ref[0, h].astype(_F32), 0.0)
      dq_ref[0, h] += jnp.dot(da.astype(k.dtype), k, precision=precision,
                              preferred_element_type=_F32)
      return carry

    jax.lax.fori_loop(0, t.head_chunk, head, 0)


def _dk_kernel(qmeta_ref, kmeta_ref, q_ref, k_ref, w_ref, g_ref, qpos_ref,
               kpos_ref, qseg_ref, kseg_ref, dk_ref, *, t: Tiles, nq, nk,
               precision):
  b, j, i, c = (pl.program_id(a) for a in range(4))

  @pl.when((i == 0) & (c == 0))
  def _():
    dk_ref[...] = jnp.zeros(dk_ref.shape, _F32)

  @pl.when(_live(qmeta_ref, kmeta_ref, b, i, j, nq, nk))
  def _():
    mask = _mask(qpos_ref, kpos_ref, qseg_ref, kseg_ref)
    g = jnp.where(mask, g_ref[0], 0.0) * t.scale  # [bq, bw]
    k = k_ref[0]

    def head(h, acc):
      qh = q_ref[0, h]
      a = jax.lax.dot_general(qh, k, _NT, precision=precision,
                              preferred_element_type=_F32)
      da = jnp.where(a > 0, g * w_ref[0, h].astype(_F32), 0.0)
      return acc + jnp.dot(da.T.astype(qh.dtype), qh, precision=precision,
                           preferred_element_type=_F32)

    dk_ref[0] += jax.lax.fori_loop(0, t.head_chunk, head,
                                   jnp.zeros(dk_ref.shape[1:], _F32))


# ------------------------------------------------------------ pallas_calls


def _specs(t: Tiles, d, order):
  """BlockSpecs for (q, k, w, [g], qpos, kpos, qseg, kseg) under a grid order.

  `order` maps grid indices to (b, i, j, c): query tile, block tile, head chunk.
  """
  bq, bw, hc = t.block_q, t.block_w, t.head_chunk

  def im(f):
    return lambda *a: f(*order(*a[:4]))

  return dict(
      q=pl.BlockSpec((1, hc, bq, d), im(lambda b, i, j, c: (b, c, i, 0))),
      k=pl.BlockSpec((1, bw, d), im(lambda b, i, j, c: (b, j, 0))),
      w=pl.BlockSpec((1, hc, bq, 1), im(lambda b, i, j, c: (b, c, i, 0))),
      g=pl.BlockSpec((1, bq, bw), im(lambda b, i, j, c: (b, i, j))),
      col=pl.BlockSpec((1, bq, 1), im(lambda b, i, j, c: (b, i, 0))),
      row=pl.BlockSpec((1, 1, bw), im(lambda b, i, j, c: (b, 0, j))),
  )


def _tile_meta(qpos, kpos, qseg, kseg, bq, bw):
  """Flat int32 SMEM tables: per query tile (max pos, min seg, max seg), per
  block tile (min pos, min seg, max seg)."""
  b = qpos.shape[0]
  qp, qs = qpos.reshape(b, -1, bq), qseg.reshape(b, -1, bq)
  kp, ks = kpos.reshape(b, -1, bw), kseg.reshape(b, -1, bw)
  qmeta = jnp.stack([qp.max(-1), qs.min(-1), qs.max(-1)], -1)
  kmeta = jnp.stack([kp.min(-1), ks.min(-1), ks.max(-1)], -1)
  return (qmeta.reshape(-1).astype(jnp.int32),
          kmeta.reshape(-1).astype(jnp.int32))


def live_tiles(q_positions, block_last_positions, q_segment_ids,
               kv_segment_ids, block_q, block_w):
  """[B, S/block_q, W/block_w] bool: the tiles the kernels compute (the rest
  are skipped). Same tables and test as in-kernel; S, W multiples of tiles."""
  qmeta, kmeta = _tile_meta(q_positions, block_last_positions, q_segment_ids,
                            kv_segment_ids, block_q, block_w)
  b = q_positions.shape[0]
  nq = q_positions.shape[1] // block_q
  nk = block_last_positions.shape[1] // block_w
  bi, ii, jj = np.meshgrid(np.arange(b), np.arange(nq), np.arange(nk),
                           indexing="ij")
  return _live(qmeta, kmeta, bi, ii, jj, nq, nk)


def _grid_sizes(t: Tiles, qt, kt):
  b, h, sp, _ = qt.shape
  return b, sp // t.block_q, kt.shape[1] // t.block_w, h // t.head_chunk


def _call(kernel, t, grid, in_specs, out_specs, out_shape, semantics, cost,
          args):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
          out_specs=out_specs),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      cost_estimate=cost,
      interpret=t.interpret,
  )(*args)


def _forward(t: Tiles, qt, kt, wt, qpos, kpos, qseg, kseg):
  """qt [B,H,Sp,D], kt [B,Wp,D], wt [B,H,Sp,1], qpos/qseg [B,Sp,1],
  kpos/kseg [B,1,Wp] -> scores [B, Sp, Wp] f32."""
  b, nq, nk, nc = _grid_sizes(t, qt, kt)
  d = qt.shape[-1]
  qmeta, kmeta = _tile_meta(qpos, kpos, qseg, kseg, t.block_q, t.block_w)
  sp = _specs(t, d, lambda b, i, j, c, *_: (b, i, j, c))
  kernel = functools.partial(_fwd_kernel, t=t, nq=nq, nk=nk,
                             precision=t.precision)
  cost = cost_estimate(qt.shape[0], qt.shape[2], kt.shape[1], qt.shape[1], d,
                       qt.dtype, t, backward=False)
  return _call(
      kernel, t, (b, nq, nk, nc),
      [sp["q"], sp["k"], sp["w"], sp["col"], sp["row"], sp["col"], sp["row"]],
      sp["g"], jax.ShapeDtypeStruct((b, qt.shape[2], kt.shape[1]), _F32),
      ("parallel", "parallel", "parallel", "arbitrary"), cost,
      (qmeta, kmeta, qt, kt, wt, qpos, kpos, qseg, kseg))


def _backward(t: Tiles, qt, kt, wt, g, qpos, kpos, qseg, kseg):
  """Returns (dq [B,H,Sp,D], dk [B,Wp,D], dw [B,H,Sp,1]), all float32."""
  b, nq, nk, nc = _grid_sizes(t, qt, kt)
  d = qt.shape[-1]
  qmeta, kmeta = _tile_meta(qpos, kpos, qseg, kseg, t.block_q, t.block_w)
  prec = t.precision
  cost = cost_estimate(qt.shape[0], qt.shape[2], kt.shape[1], qt.shape[1], d,
                       qt.dtype, t, backward=True)
  args = (qmeta, kmeta, qt, kt, wt, g, qpos, kpos, qseg, kseg)

  # dq, dweights: grid (b, i, c, j), W tiles innermost.
  sp = _specs(t, d, lambda b, i, c, j, *_: (b, i, j, c))
  dq, dw = _call(
      functools.partial(_dq_kernel, t=t, nq=nq, nk=nk, precision=prec), t,
      (b, nq, nc, nk),
      [sp["q"], sp["k"], sp["w"], sp["g"], sp["col"], sp["row"], sp["col"],
       sp["row"]],
      [sp["q"], sp["w"]],
      [jax.ShapeDtypeStruct(qt.shape, _F32),
       jax.ShapeDtypeStruct(wt.shape, _F32)],
      ("parallel", "parallel", "parallel", "arbitrary"), cost, args)

  # dk: grid (b, j, i, c), S tiles and head chunks innermost.
  sp = _specs(t, d, lambda b, j, i, c, *_: (b, i, j, c))
  dk = _call(
      functools.partial(_dk_kernel, t=t, nq=nq, nk=nk, precision=prec), t,
      (b, nk, nq, nc),
      [sp["q"], sp["k"], sp["w"], sp["g"], sp["col"], sp["row"], sp["col"],
       sp["row"]],
      sp["k"], jax.ShapeDtypeStruct(kt.shape, _F32),
      ("parallel", "parallel", "arbitrary", "arbitrary"), cost, args)
  return dq, dk, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _score(t, qt, kt, wt, qpos, kpos, qseg, kseg):
  return _forward(t, qt, kt, wt, qpos, kpos, qseg, kseg)


def _score_fwd(t, qt, kt, wt, qpos, kpos, qseg, kseg):
  return (_forward(t, qt, kt, wt, qpos, kpos, qseg, kseg),
          (qt, kt, wt, qpos, kpos, qseg, kseg))


def _score_bwd(t, res, g):
  qt, kt, wt, qpos, kpos, qseg, kseg = res
  dq, dk, dw = _backward(t, qt, kt, wt, g, qpos, kpos, qseg, kseg)
  return (dq.astype(qt.dtype), dk.astype(kt.dtype), dw.astype(wt.dtype),
          None, None, None, None)


_score.defvjp(_score_fwd, _score_bwd)


def _pad_axis(x, axis, n, value=0, mode="constant"):
  if n == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n)
  if mode == "edge":
    return jnp.pad(x, pad, mode="edge")
  return jnp.pad(x, pad, constant_values=value)


def score_pallas(q, k_compressed, weights, *, softmax_scale, q_positions,
                 block_last_positions, precision, q_segment_ids=None,
                 kv_segment_ids=None, block_q=None, block_w=None,
                 head_chunk=None, interpret=None):
  """See `linear_attention.ops.csa_streamindex_score`; float32 [B, S, W].

  Args (beyond the op's): block_q (default 128), block_w (default 512),
  head_chunk (default the largest divisor of H up to 16); interpret: True
  runs the kernels in Pallas interpret mode on any device (slow: tests);
  None compiles them with Mosaic, which needs a TPU.

  A call `supports` takes (tiles within the TPU block rules; a TPU, or
  interpret=True).
  """
  bsz, s, h, d = q.shape
  w = k_compressed.shape[1]
  bq, bw, hc = resolve_tiles(s, w, h, block_q=block_q, block_w=block_w,
                             head_chunk=head_chunk)
  t = Tiles(float(softmax_scale), bq, bw, hc, bool(interpret), precision)
  if q_segment_ids is None:
    q_segment_ids = jnp.zeros((bsz, s), jnp.int32)
    kv_segment_ids = jnp.zeros((bsz, w), jnp.int32)
  ps, pw = -s % bq, -w % bw
  i32 = lambda x: x.astype(jnp.int32)
  qt = _pad_axis(jnp.transpose(q, (0, 2, 1, 3)), 2, ps)
  # weights enter as float32 ([B, S, H] is small; a (bq, 1) f32 column
  # avoids packed-bf16 layouts in VMEM); their gradient returns in f32 and
  # autodiff casts it back to weights.dtype.
  wt = _pad_axis(jnp.transpose(weights.astype(_F32), (0, 2, 1))[..., None],
                 2, ps)
  kt = _pad_axis(k_compressed, 1, pw)
  qpos = _pad_axis(i32(q_positions), 1, ps, _IMIN)[..., None]
  qseg = _pad_axis(i32(q_segment_ids), 1, ps, mode="edge")[..., None]
  kpos = _pad_axis(i32(block_last_positions), 1, pw, _IMAX)[:, None, :]
  kseg = _pad_axis(i32(kv_segment_ids), 1, pw, mode="edge")[:, None, :]
  out = _score(t, qt, kt, wt, qpos, kpos, qseg, kseg)
  return out[:, :s, :w]


def cost_estimate(b, s, w, h, d, dtype, t: Tiles, *, backward=False):
  """FLOPs and HBM bytes of the kernels (no tile skipping), for rooflines.

  Forward: 2 B S W H D matmul FLOPs plus 3 B S W H elementwise (relu, scale,
  add). Backward: A is recomputed twice (dq/dw and dk kernels) and the dq and
  dk matmuls add 2 B S W H D each, plus ~8 B S W H elementwise. Bytes count
  each block fetch: q and weights are re-read once per W tile, k once per
  S tile (per head chunk in the dk kernel), scores / G once.
  """
  item = jnp.dtype(dtype).itemsize
  nq, nk = -(-s // t.block_q), -(-w // t.block_w)
  sp, wp = nq * t.block_q, nk * t.block_w
  q_bytes, k_bytes = b * sp * h * d * item, b * wp * d * item
  w_bytes, sw_bytes = b * sp * h * 4, b * sp * wp * 4
  if not backward:
    flops = 2 * b * sp * wp * h * d + 3 * b * sp * wp * h
    hbm = nk * (q_bytes + w_bytes) + nq * k_bytes + sw_bytes
  else:
    flops = 8 * b * sp * wp * h * d + 8 * b * sp * wp * h
    nc = h // t.head_chunk
    # dq/dw kernel: q, w read once (resident over W), k and G per (i, c).
    hbm_dq = q_bytes + w_bytes + nq * nc * k_bytes + nc * sw_bytes + \
        b * sp * h * d * 4 + b * sp * h * 4
    # dk kernel: q, w, G per W tile, k read once, dk written once.
    hbm_dk = nk * (q_bytes + w_bytes + sw_bytes) + k_bytes + b * wp * d * 4
    hbm = hbm_dq + hbm_dk
  return pl.CostEstimate(flops=int(flops), transcendentals=0,
                         bytes_accessed=int(hbm))
