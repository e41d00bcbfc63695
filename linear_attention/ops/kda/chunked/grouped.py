"""The dense schedule (no segments): a scan over groups of chunks.

See `chunked/__init__.py` (Schedule) for why groups: intermediates stay in
cache, and the checkpointed step recomputes a group in the backward.
"""

import jax
import jax.numpy as jnp

from linear_attention.ops.kda import common
from linear_attention.ops.kda.chunked import intra
from linear_attention.ops.kda.chunked import linalg

# Chunk-heads x K per step of the grouped scan, in 64-token chunks: 16 chunks
# of K = 64 (1024 tokens x heads), a working set of a few MiB that stays in
# cache (see `dense_core`); smaller chunks take as many tokens a step.
GROUP_WIDTH = 16 * 64
# A group's chunks are unrolled in the scan step: compile time grows with
# their number (at B * H = 1, K = 32 on 16-token chunks the width above asks
# for 128 chunks, and the forward alone took minutes to compile). 16 keeps
# every shape's step as small as the benchmarked (1, 4096, 4, 64) one.
MAX_GROUP_CHUNKS = 16


def group_size(num_chunks, batch_heads, head_dim, chunk=64,
               width=GROUP_WIDTH):
  """(chunks per group, groups) of the grouped scan; groups * size >= chunks.

  About `width` / 64 64-token chunk-heads at K = 64 per group (default
  1024 tokens x heads; fewer when K is larger), at most `MAX_GROUP_CHUNKS`
  chunks, sized so that padding the last group wastes less than one chunk
  per group.
  """
  width = width * 64 // chunk  # the same tokens per step at any chunk
  size = max(1, min(num_chunks, MAX_GROUP_CHUNKS,
                    width // (batch_heads * head_dim)))
  groups = -(-num_chunks // size)
  return -(-num_chunks // groups), groups


def dense_core(q, k, v, g, beta, init, *, prep, tiling, precision):
  """Raw inputs without segments -> (o [B,T,H,V], finals [B,1,H,K,V]).

  The chunk math of `chunked/__init__.py`, computed group by group: a
  `lax.scan` over groups of `group_size` chunks (all heads and rows of the
  batch) carries the state [B * H, K, V] (`init` [B, H, K, V] in the compute dtype).
  Inside a step, the group's tokens are prepared (`prep`: `common.prepare`
  on a slice; gates, L2 norm, casts), cut into chunks, their intra-chunk work
  is batched, the group's chunks update the state one after another
  (V_new = U - W X, then X' = exp(G_C) X + K_end^T V_new), and the outputs
  are read. A whole-sequence pass makes every intermediate
  ([.., C, C] scores, [.., C, K] factors) a DRAM round trip; per group they
  stay in cache, which on a CPU halves the forward. The step is
  `jax.checkpoint`ed: the backward recomputes a group from its inputs and
  carried state instead of storing every intermediate. `precision`: the
  op's `Precisions`.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c = tiling.chunk
  gs, ng = group_size(-(-t // c), b * h, kd, c, tiling.group_width)
  span = gs * c
  pad = ng * span - t
  if pad:  # padding writes nothing (k, v, beta = 0); its g is zeroed below
    pad_t = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(pad_t, (q, k, v, g, beta))

  # [B, T, H, *] -> [NG, B, GS * C, H, *] (a reshape when B = 1)
  to_groups = lambda x: jnp.moveaxis(x.reshape((b, ng, span) + x.shape[2:]),
                                     1, 0)
  xs = tuple(map(to_groups, (q, k, v, g, beta)))
  xs += ((jnp.arange(ng * span) < t).reshape(ng, span),)
  # [B, GS * C, H, *] -> [GS, B * H, C, *], in cache
  chunks = lambda x: jnp.transpose(x.reshape((b, gs, c, h, -1)),
                                   (1, 0, 3, 2, 4)).reshape(gs, b * h, c, -1)

  def step(state, group):
    *raw, real = group
    qg, kg, vg, gg, bg = prep(*raw)[:5]
    if pad:  # padding does not decay the state
      gg = jnp.where(real[None, :, None, None], gg, 0.0)
    qc, kc, vc, gc = map(chunks, (qg, kg, vg, gg))
    bc = chunks(bg[..., None])[..., 0]
    dec = intra.intra_chunk(qc, kc, gc, sub=tiling.sub,
                            bounded=tiling.bounded,
                            precision=precision.scores)
    wu, q_dec = intra.ut_transform(qc, kc, vc, bc, dec, precision)
    w, u = wu[..., :kd], wu[..., kd:]
    k_end = linalg.transposed(kc * dec.to_end)  # [GS, B * H, K, C]
    # Per-chunk operands by one split each: its transpose is one concatenate
    # (indexing chunk by chunk would transpose to GS full-size pads and adds).
    per_chunk = lambda x: [y[0] for y in jax.lax.split(x, (1,) * gs)]
    ws, us, k_ends, totals = map(per_chunk, (w, u, k_end, dec.total))
    carried, v_new = [], []  # the state entering each chunk; its errors
    for j in range(gs):
      carried.append(state)
      v_new.append(us[j] - linalg.mm(ws[j], state, precision.state))
      state = totals[j][..., None] * state + linalg.mm(
          k_ends[j], v_new[j], precision.state)
    carried, v_new = jnp.stack(carried), jnp.stack(v_new)
    o = (linalg.mm(q_dec, carried, precision.state)
         + linalg.mm(dec.a_qk, v_new, precision.output))
    o = jnp.transpose(o.reshape(gs, b, h, c, vd), (1, 0, 3, 2, 4))
    return state, o.reshape(b, span, h, vd)

  carry0 = common.vary_like(init.reshape(b * h, kd, vd), xs, init)
  last, o = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), carry0, xs)
  o = jnp.moveaxis(o, 0, 1).reshape(b, ng * span, h, vd)[:, :t]
  return o, last.reshape(b, 1, h, kd, vd)
