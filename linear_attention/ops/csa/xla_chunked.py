"""The CSA indexer score in XLA, tiled so that [B, H, S, W] never exists.

Same math as `reference` (c = softmax_scale, A = q k^T per head):

    score[b, s, w] = c * sum_h weights[b, s, h] * relu(A[b, s, h, w])

Forward: a `fori_loop` over query tiles of `block_q` rows, and inside it a
`fori_loop` over head chunks of `head_chunk` heads, each adding
`sum_h weights * relu(q_tile k^T)` into a [B, block_q, W] float32 tile; the
mask is applied per tile and the tile is written into the [B, S, W] output.
The largest temporary is [B, block_q, head_chunk, W].

Backward (`jax.custom_vjp`; the residuals are the inputs only): the same two
loops recompute A tile by tile, with G = dL/dscore zeroed on masked entries
(DeepSeek-V4 inference code `Indexer`, MaxText `csa_streamindex.py`):

    dweights = c sum_w G relu(A)
    dA       = c G weights 1[A > 0]
    dq       = sum_w dA k
    dk       = sum_{h, s} dA q

dq and dweights are written per tile; dk is a float32 carry. Operands keep
their input dtype (bf16 in, bf16 matmuls) and accumulate in float32; the
products with q or k run at the call's precision (HIGHEST for float32
inputs at "auto"), the head sums over float32 relu(A) at HIGHEST.
"""

import functools

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.csa import common
from linear_attention.ops.csa import reference

DEFAULT_BLOCK_Q = 256
DEFAULT_HEAD_CHUNK = 4

_F32 = jnp.float32

NAME = "xla_chunked"
OPTIONS = ("block_q", "head_chunk")  # tuning arguments it takes


supports_target = backends.no_limit  # plain XLA: every device


def supports(call: common.Call) -> str | None:
  h = call.q.shape[2]
  hc = call.options.get("head_chunk") or min(h, DEFAULT_HEAD_CHUNK)
  if h % hc:
    return f"it needs head_chunk to divide H; got head_chunk={hc}, H={h}."
  return None


def run(call: common.Call):
  return call.run(score_xla_chunked)


def _tile(x, t, bq):
  return jax.lax.dynamic_slice_in_dim(x, t * bq, bq, axis=1)


def _heads(x, c, hc):
  return jax.lax.dynamic_slice_in_dim(x, c * hc, hc, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _score(scale, bq, hc, prec, q, k, w, qpos, kpos, qseg, kseg):
  b, sp, h, _ = q.shape
  nw = k.shape[1]

  def tile(t, out):
    q_t, w_t = _tile(q, t, bq), _tile(w, t, bq).astype(_F32)

    def chunk(c, acc):
      a = jnp.einsum("bqhd,bwd->bqhw", _heads(q_t, c, hc), k,
                     preferred_element_type=_F32, precision=prec)
      return acc + jnp.einsum("bqh,bqhw->bqw", _heads(w_t, c, hc),
                              jax.nn.relu(a),
                              precision=jax.lax.Precision.HIGHEST)

    acc = jax.lax.fori_loop(0, h // hc, chunk, jnp.zeros((b, bq, nw), _F32))
    mask = reference.visible_mask(_tile(qpos, t, bq), kpos,
                                  _tile(qseg, t, bq), kseg)
    s = jnp.where(mask, scale * acc, -jnp.inf)
    return jax.lax.dynamic_update_slice_in_dim(out, s, t * bq, axis=1)

  return jax.lax.fori_loop(0, sp // bq, tile,
                           jnp.zeros((b, sp, nw), _F32))


def _score_fwd(scale, bq, hc, prec, q, k, w, qpos, kpos, qseg, kseg):
  out = _score(scale, bq, hc, prec, q, k, w, qpos, kpos, qseg, kseg)
  return out, (q, k, w, qpos, kpos, qseg, kseg)


def _score_bwd(scale, bq, hc, prec, res, g):
  q, k, w, qpos, kpos, qseg, kseg = res
  b, sp, h, d = q.shape
  hi = jax.lax.Precision.HIGHEST

  def tile(t, carry):
    dq, dw, dk = carry
    q_t, w_t = _tile(q, t, bq), _tile(w, t, bq).astype(_F32)
    mask = reference.visible_mask(_tile(qpos, t, bq), kpos,
                                  _tile(qseg, t, bq), kseg)
    # where, not multiply: a non-finite cotangent on a masked entry stays out.
    g_t = jnp.where(mask, _tile(g, t, bq), 0.0) * scale

    def chunk(c, carry):
      dq_t, dw_t, dk = carry
      q_c = _heads(q_t, c, hc)
      a = jnp.einsum("bqhd,bwd->bqhw", q_c, k, preferred_element_type=_F32,
                     precision=prec)
      dw_c = jnp.einsum("bqw,bqhw->bqh", g_t, jax.nn.relu(a), precision=hi)
      da = jnp.where(a > 0, g_t[:, :, None, :] * _heads(w_t, c, hc)[..., None],
                     0.0).astype(q.dtype)
      dq_c = jnp.einsum("bqhw,bwd->bqhd", da, k, preferred_element_type=_F32,
                        precision=prec)
      dk = dk + jnp.einsum("bqhw,bqhd->bwd", da, q_c,
                           preferred_element_type=_F32, precision=prec)
      dq_t = jax.lax.dynamic_update_slice_in_dim(dq_t, dq_c, c * hc, axis=2)
      dw_t = jax.lax.dynamic_update_slice_in_dim(dw_t, dw_c, c * hc, axis=2)
      return dq_t, dw_t, dk

    dq_t, dw_t, dk = jax.lax.fori_loop(
        0, h // hc, chunk,
        (jnp.zeros((b, bq, h, d), _F32), jnp.zeros((b, bq, h), _F32), dk))
    dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_t, t * bq, axis=1)
    dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_t, t * bq, axis=1)
    return dq, dw, dk

  dq, dw, dk = jax.lax.fori_loop(
      0, sp // bq, tile,
      (jnp.zeros(q.shape, _F32), jnp.zeros(w.shape, _F32),
       jnp.zeros(k.shape, _F32)))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dw.astype(w.dtype),
          None, None, None, None)


_score.defvjp(_score_fwd, _score_bwd)


def _pad_rows(x, n, value):
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, n)
  return jnp.pad(x, pad, constant_values=value)


def score_xla_chunked(q, k_compressed, weights, *, softmax_scale, q_positions,
                      block_last_positions, precision, q_segment_ids=None,
                      kv_segment_ids=None, block_q=None, head_chunk=None):
  """See `linear_attention.ops.csa_streamindex_score`; float32 [B, S, W].

  Args (beyond the op's): block_q, query rows per tile (default 256, capped
  at S; S is padded to a multiple inside, padded rows are masked and dropped);
  head_chunk, heads per inner step (default min(H, 4)); must divide H
  (`supports`).
  """
  _, s, h, _ = q.shape
  bq = min(block_q or DEFAULT_BLOCK_Q, s)
  hc = head_chunk or min(h, DEFAULT_HEAD_CHUNK)
  if q_segment_ids is None:
    q_segment_ids = jnp.zeros(q_positions.shape, jnp.int32)
    kv_segment_ids = jnp.zeros(block_last_positions.shape, jnp.int32)
  pad = -s % bq
  if pad:
    imin = jnp.iinfo(q_positions.dtype).min
    q = _pad_rows(q, pad, 0)
    weights = _pad_rows(weights, pad, 0)
    q_positions = _pad_rows(q_positions, pad, imin)
    q_segment_ids = _pad_rows(q_segment_ids, pad, 0)
  out = _score(float(softmax_scale), bq, hc, precision, q, k_compressed,
               weights,
               q_positions, block_last_positions, q_segment_ids,
               kv_segment_ids)
  return out[:, :s]
