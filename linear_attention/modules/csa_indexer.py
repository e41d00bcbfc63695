"""DeepSeek-V4 Compressed Sparse Attention (CSA) lightning indexer, in Haiku.

Glossary of shapes: B batch, S tokens, M model width, H indexer heads,
D indexer head dim, r compress_rate, W = floor(S / r) compressed blocks,
k top-k.

Sources: DeepSeek-V4 inference code (`Compressor`, `Indexer`), MaxText
`kernels/attention/csa_streamindex.py`.

Compressor (overlapping windows of 2r tokens). Per token t, two linear maps
give kv_t, z_t in R^{2D}; z gets a learned position bias ape[t mod r]. Block
w pools the window of the previous block's r tokens (first D channels) and
its own r tokens (last D channels), per channel c:

    p = softmax over the 2r window of [z_prev[:, c], z_own[:, D + c]]
    k_w[c] = sum_window p * [kv_prev[:, c], kv_own[:, D + c]]

Block 0 has no previous block: that half uses kv = 0 and z = -inf (so it
gets zero weight). Then k_w = RoPE(RMSNorm(k_w)), interleaved rotary
embedding on the last `rope_dim` channels at position w r (the position of
the block's first token when `positions` is given).

Indexer: q = RoPE(Linear_{q_rank -> H D}(q_lowrank)) per head (same rotary
layout, at each token's position), weights = Linear_{M -> H}(x) H^-1/2, and

    score[s, w] = D^-1/2 sum_h weights[s, h] relu(q[s, h] . k_w)

with block w visible to token s once its last token is in the past
((w + 1) r - 1 <= s, compared within a document when packed). The top-k
visible blocks per token are returned; slots beyond the visible blocks hold
-1. The FP8 quantisation and the Hadamard rotation of the released code are
left out (the rotation is orthogonal on both q and k, so q . k is unchanged).

Every matmul (the five projections and the score's q . k) runs at the
module's `precision` (`linear_attention.ops.precision`: "auto" is
float32-exact for float32 activations, one bfloat16 pass for bfloat16),
whatever `jax.default_matmul_precision` says.
"""

from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from linear_attention import ops
from linear_attention.modules import pinned
from linear_attention.ops import checks
from linear_attention.ops import precision as precision_lib
from linear_attention.ops.csa import api as csa_api


class IndexerOutput(NamedTuple):
  indices: jax.Array  # [B, S, k] int32 block ids, -1 past the visible blocks
  scores: jax.Array  # [B, S, W] float32, -inf where invisible
  k_compressed: jax.Array  # [B, W, D] compressed keys (after norm and RoPE)


def apply_interleaved_rope(x, positions, rope_dim, theta):
  """Rotates pairs (x[2i], x[2i+1]) of the last `rope_dim` channels.

  angle_i = position * theta^(-2i / rope_dim); x: [..., C], positions
  broadcastable to x.shape[:-1].
  """
  if rope_dim == 0:
    return x
  c = x.shape[-1]
  head, tail = x[..., :c - rope_dim], x[..., c - rope_dim:]
  inv = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float32) / rope_dim)
  ang = positions[..., None].astype(jnp.float32) * inv  # [..., rope_dim / 2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  pairs = tail.astype(jnp.float32).reshape(*tail.shape[:-1], rope_dim // 2, 2)
  x0, x1 = pairs[..., 0], pairs[..., 1]
  rot = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)
  rot = rot.reshape(tail.shape).astype(x.dtype)
  return jnp.concatenate([head, rot], axis=-1)


class CompressedSparseIndexer(hk.Module):
  """DeepSeek-V4 CSA indexer: compressor, score, top-k (see the module doc)."""

  def __init__(
      self,
      num_heads: int,  # H, indexer heads (V4-Flash: 64)
      head_dim: int,  # D, indexer head dim (V4-Flash: 128)
      compress_rate: int,  # r, tokens per compressed block (V4 CSA: 4)
      topk: int,  # k, blocks kept per token (V4-Flash: 512)
      rope_dim: int = 64,  # rotary channels at the end of each D vector
      q_rank: int | None = None,  # width of the low-rank query made from x
      rope_theta: float = 10000.0,  # rotary base
      score_backend: str = "reference",  # ops.csa_streamindex_score backend
      interpret: bool | None = None,  # pallas only: True = interpret mode
      block_q: int | None = None,  # score tiles (xla_chunked / pallas)
      block_w: int | None = None,  # (pallas only)
      head_chunk: int | None = None,  # (xla_chunked / pallas)
      norm_eps: float = 1e-6,  # RMSNorm epsilon
      precision: str = "auto",  # of every matmul (ops/precision.py)
      name: str | None = None,
  ):
    super().__init__(name=name)
    for field, value, low in (("num_heads", num_heads, 1),
                              ("head_dim", head_dim, 1),
                              ("compress_rate", compress_rate, 1),
                              ("topk", topk, 1), ("rope_dim", rope_dim, 0)):
      checks.int_at_least(field, value, low)
    checks.int_at_least("q_rank", q_rank, 1, optional=True)
    if rope_dim > head_dim or rope_dim % 2:
      raise ValueError(f"rope_dim must be even and <= head_dim={head_dim};"
                       f" got {rope_dim}.")
    checks.positive_number("rope_theta", rope_theta)
    checks.positive_number("norm_eps", norm_eps)
    precision_lib.validate(precision)
    self.score_backend = csa_api.BACKENDS.parse(score_backend)
    self.num_heads, self.head_dim = num_heads, head_dim
    self.compress_rate, self.topk = compress_rate, topk
    self.rope_dim, self.q_rank, self.rope_theta = rope_dim, q_rank, rope_theta
    self.norm_eps, self.precision = norm_eps, precision
    self.score_options = {
        k: v for k, v in dict(interpret=interpret, block_q=block_q,
                              block_w=block_w, head_chunk=head_chunk).items()
        if v is not None}

  @hk.transparent  # no scope of its own: the caller's parameter names
  def _linear(self, x, size, name):
    """x W (no bias, Haiku's default init) at the module's precision."""
    return pinned.linear(x, size, precision=self.precision, name=name)

  def compress(self, x, positions=None, segment_ids=None):
    """[B, S, M] -> compressed keys [B, W, D] (float32 math, x's dtype out)."""
    b, s, _ = x.shape
    r, d = self.compress_rate, self.head_dim
    nw = s // r
    xb = x[:, :nw * r]
    kv = self._linear(xb, 2 * d, "compressor_kv")
    z = self._linear(xb, 2 * d, "compressor_gate")
    ape = hk.get_parameter("compressor_ape", (r, 2 * d), jnp.float32,
                           init=jnp.zeros)
    kv = kv.reshape(b, nw, r, 2 * d).astype(jnp.float32)
    z = z.reshape(b, nw, r, 2 * d).astype(jnp.float32) + ape
    pad = lambda a, v: jnp.concatenate(
        [jnp.full((b, 1, r, d), v, jnp.float32), a[:, :-1, :, :d]], axis=1)
    kv_prev, z_prev = pad(kv, 0.0), pad(z, -jnp.inf)
    if segment_ids is not None:
      # A previous block from another document does not take part.
      seg = segment_ids[:, r - 1:nw * r:r]
      same = jnp.concatenate(
          [jnp.zeros((b, 1), bool), seg[:, 1:] == seg[:, :-1]], axis=1)
      z_prev = jnp.where(same[:, :, None, None], z_prev, -jnp.inf)
    kv_win = jnp.concatenate([kv_prev, kv[..., d:]], axis=2)  # [B,W,2r,D]
    p = jax.nn.softmax(jnp.concatenate([z_prev, z[..., d:]], axis=2), axis=2)
    pooled = jnp.sum(kv_win * p, axis=2).astype(x.dtype)
    pooled = hk.RMSNorm(-1, eps=self.norm_eps, name="compressor_norm")(pooled)
    if positions is None:
      start = jnp.broadcast_to(jnp.arange(nw) * r, (b, nw))
    else:
      start = positions[:, 0:nw * r:r]
    return apply_interleaved_rope(pooled, start, self.rope_dim,
                                  self.rope_theta)

  def __call__(self, x, q_lowrank=None, *, positions=None, segment_ids=None):
    """Scores and top-k compressed blocks for every token.

    Args:
      x: [B, S, M] hidden states (S >= compress_rate).
      q_lowrank: [B, S, q_rank] the low-rank query the model shares with its
        attention (DeepSeek-V4's `qr`); when None it is made here as
        RMSNorm(Linear_{M -> q_rank}(x)), which needs `q_rank`.
      positions: [B, S] int token positions (restart per packed document);
        default arange(S).
      segment_ids: [B, S] int packed-document ids; blocks are visible only
        inside their document. Pack documents at multiples of
        compress_rate: a block is pooled from its own tokens as they are.

    Returns:
      IndexerOutput(indices [B, S, topk] int32, scores [B, S, W] float32,
      k_compressed [B, W, D]).
    """
    if getattr(x, "ndim", None) != 3:
      raise ValueError(f"x must have shape [B, S, M]; got"
                       f" {getattr(x, 'shape', x)}.")
    b, s, _ = x.shape
    r, h, d = self.compress_rate, self.num_heads, self.head_dim
    if s < r:
      raise ValueError(f"x's length S={s} must be >= compress_rate={r}.")
    for name, a in (("positions", positions), ("segment_ids", segment_ids)):
      if a is not None and (tuple(a.shape) != (b, s)
                            or not jnp.issubdtype(a.dtype, jnp.integer)):
        raise ValueError(f"{name} must be an int array of shape [B, S] ="
                         f" {(b, s)}; got {a.dtype} {tuple(a.shape)}.")
    if q_lowrank is None:
      if self.q_rank is None:
        raise ValueError("q_rank is required when q_lowrank is not given.")
      q_lowrank = self._linear(x, self.q_rank, "q_a")
      q_lowrank = hk.RMSNorm(-1, eps=self.norm_eps, name="q_a_norm")(
          q_lowrank)
    elif (getattr(q_lowrank, "ndim", None) != 3
          or tuple(q_lowrank.shape[:2]) != (b, s)):
      raise ValueError(f"q_lowrank must have shape [B, S, q_rank] with"
                       f" B, S = {(b, s)}; got"
                       f" {getattr(q_lowrank, 'shape', q_lowrank)}.")
    nw = s // r
    pos = (jnp.broadcast_to(jnp.arange(s), (b, s)) if positions is None
           else positions)
    k_c = self.compress(x, positions, segment_ids)
    q = self._linear(q_lowrank, h * d, "q_b")
    q = apply_interleaved_rope(q.reshape(b, s, h, d), pos[:, :, None],
                               self.rope_dim, self.rope_theta)
    weights = self._linear(x, h, "weights_proj") * h**-0.5
    kw = {}
    if positions is not None:
      kw.update(q_positions=positions,
                block_last_positions=positions[:, r - 1:nw * r:r])
    if segment_ids is not None:
      kw.update(q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids[:, r - 1:nw * r:r])
    scores = ops.csa_streamindex_score(
        q, k_c.astype(q.dtype), weights.astype(q.dtype),
        softmax_scale=d**-0.5, compress_rate=r, backend=self.score_backend,
        precision=self.precision, **self.score_options, **kw)
    return IndexerOutput(top_k_blocks(scores, self.topk), scores, k_c)


def top_k_blocks(scores, k):
  """[B, S, W] scores -> [B, S, k] int32 block ids, best first; -1 where
  fewer than k blocks are visible (score -inf) or k > W."""
  nw = scores.shape[-1]
  vals, idx = jax.lax.top_k(scores, min(k, nw))
  idx = jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)
  if k > nw:
    idx = jnp.pad(idx, [(0, 0), (0, 0), (0, k - nw)], constant_values=-1)
  return idx
