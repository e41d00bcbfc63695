"""Chunked KDA in XLA: the WY / UT-transform form, exact for any decay.

Kimi Linear (arXiv 2510.26692, §3.2). Split the sequence into chunks of
C tokens (`chunk_size`: 16 on CPU, 64 elsewhere). Inside a chunk, with
incoming state X and G_i the cumulative log decay from the chunk start up to
and including token i:

    A[i, j]   = beta_i sum_d k_id k_jd exp(G_id - G_jd)      (j < i)
    M         = (I + A)^-1 Diag(beta)                        (unit lower solve)
    W = M (exp(G) * K),   U = M V                            (the UT transform)
    V_new     = U - W X                                      (delta-rule errors)
    O         = (Q * exp(G)) X + tril(A_qk) V_new,  A_qk[i, j] = q_i . (exp(G_i - G_j) * k_j)
    X_next    = exp(G_C) * X + (exp(G_C - G) * K)^T V_new

Schedule (`_grouped_core`, inputs without segments). A `lax.scan` over groups
of chunks (about 1024 tokens x heads at K = 64) carries the state: inside a
step the group's intra-chunk work is batched (scores, solve, UT transform),
the group's chunks update the state one after another (two matmuls each: W X,
then the update above), and the outputs of the whole group are read in one
batched pass. Every intermediate stays in cache; a whole-sequence pass makes
each one a DRAM round trip (on the 2-core dev machine, memory past the 32 MiB
L3 streams at ~3 GiB/s). The step is `jax.checkpoint`ed, so the backward
recomputes a group from its inputs and state instead of storing [.., C, C]
residuals. With segments (`_chunked_core`), the same pieces run over all
chunks at once and only the chunks' affine state maps are scanned: X_next =
T_c X + R_c with T_c = Diag(exp(G_C)) - (exp(G_C - G) K)^T W and R_c =
(exp(G_C - G) K)^T U (a segment start resets the state between them).

Numerics. Nothing overflows at any decay (a chunk of 64 tokens at
lower_bound=-5 spans -320; pre-activated decays may go to -1000 and below):
exp(G_i - G_j) is never split as exp(G_i) exp(-G_j) over a chunk, and every
exponent is a sum of g over its own range (never a difference of two long
cumulative sums, which would lose ulp(G) of absolute precision). The chunk is
cut into blocks of S tokens (`block_size`: 16; 32 or 64 under a lower-bound
gate above -5, where S * |lower_bound| <= 80). A pair in different blocks
factors exactly into three exponents, each <= 0: within the row's block, the
whole blocks between, and within the column's block, so each block's scores
are one matmul of [2S, K] rows and [C, K] columns. Inside a block the pair
factors as exp(incl_i) exp(-incl_j) when |incl| <= 80 (always under a
lower-bound gate); otherwise a runtime branch uses the exact masked exponent
on [16, 16, K]. A 16-token chunk is a single block. Range sums are matmuls
with 0/1 matrices (`_range_sums`); the UT transform is a blocked forward
substitution on 16 x 16 blocks (`_ut_solve`). Accumulation is float32
throughout.

Gradients. Range sums, the UT solve (its VJP is a back substitution) and the
matmuls whose autodiff form is slow on CPU have custom VJPs (closed forms; a
forward+backward at (1, 4096, 4, 64) is ~30% faster than with autodiff through
them), so the backend supports reverse-mode differentiation only (`jax.grad`,
`jax.vjp`; `jax.jvp` raises). Measured against a float64 recurrence at T =
4096 (bounds -5 and -1): 4e-7 relative L2 on the output.

Packed segments (see `common`): a run of a segment may start anywhere inside a
chunk. Cumulative decays restart at each run start, A and A_qk are masked to
pairs in the same run, tokens of a run that started before the chunk read the
carried state, and tokens of a run that starts inside it read their segment's
initial state.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.ops import backends
from linear_attention.ops.kda import common

SUB = 16  # block size when the decays are unbounded (or bounded below -5)
# exp(-x) is finite in float32 for x <= 88; 16 tokens at -5 give 80.
_FACTOR_LIMIT = 80.0
_HIGHEST = jax.lax.Precision.HIGHEST


def block_size(lower_bound, use_gate_in_kernel,
               chunk=64) -> tuple[int, bool]:
  """(block size, bounded): the largest block the exp split is safe over.

  Under a lower-bound gate every g >= lower_bound, so a block of S tokens
  spans at most S * |lower_bound|; the diagonal blocks may factor as
  exp(incl_i) exp(-incl_j) when that is <= 80. At -5 that is 16 tokens; at
  -2.5, 32; from -1.25 up, the whole 64-token chunk is one block (no
  off-diagonal products). Other gates: 16, with a runtime check (`bounded`
  False).
  """
  if not (use_gate_in_kernel and lower_bound is not None):
    return SUB, False
  for size in (chunk, chunk // 2):
    if size >= SUB and size * abs(lower_bound) <= _FACTOR_LIMIT:
      return size, True
  return SUB, True


def _segmented_cumsum(x, starts, axis):
  """Cumulative sum along `axis` that restarts where `starts` is True."""

  def combine(a, b):
    fa, va = a
    fb, vb = b
    return fa | fb, jnp.where(fb, vb, va + vb)

  starts = jnp.broadcast_to(starts, x.shape)
  return jax.lax.associative_scan(combine, (starts, x), axis=axis)[1]


def _range_sums(x, size, relation):
  """y[i] = sum of x[j] over j in i's block of `size` with relation(i, j).

  Along axis -2 of x [..., S, K] (S a multiple of `size`). Each block is a
  matmul with a [size, size] 0/1 matrix: each output is the float32 sum of
  exactly its range (HIGHEST precision: no reduced-precision passes on
  GPU/TPU), and its transpose is another such matmul. On CPU this is several
  times faster than `lax.cumsum` (a quadratic reduce-window), and the scores
  come out more accurate than from `lax.associative_scan` sums (tested
  against float64: the a_log gradient's error halves at lower_bound=-2.5).
  The 0/1 matrix is broadcast over the blocks, so the product is a batched
  matmul whose output is already in x's layout, and the VJP multiplies by
  the transposed matrix the same way (autodiff would transpose the data).
  """
  i = np.arange(size)
  mask = relation(i[:, None], i[None, :]).astype(np.float32)
  shape = x.shape

  def apply(m, y):
    y3 = y.reshape((-1, size, shape[-1]))
    mb = jnp.broadcast_to(jnp.asarray(m, y.dtype), (y3.shape[0], size, size))
    out = jax.lax.dot_general(mb, y3, (((2,), (1,)), ((0,), (0,))),
                              precision=_HIGHEST)
    return out.reshape(shape)

  @jax.custom_vjp
  def sums(y):
    return apply(mask, y)

  sums.defvjp(lambda y: (apply(mask, y), None),
              lambda _, g: (apply(mask.T, g),))
  return sums(x)


def _transposed(x):
  """x with its last two axes swapped, as an array of its own."""
  return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


@jax.custom_vjp
def _mm(a, b):
  """a @ b for [..., M, K] x [..., K, N] with equal batch axes.

  Its VJP computes a^T g from a materialised a^T: autodiff's form contracts
  over a's major axis, which XLA:CPU sends to a dot path ~2x slower.
  """
  return a @ b


def _mm_fwd(a, b):
  return a @ b, (a, b)


def _mm_bwd(res, g):
  a, b = res
  return _mm_nt(g, b), _transposed(a) @ g


_mm.defvjp(_mm_fwd, _mm_bwd)


@jax.custom_vjp
def _mm_nt(a, b):
  """a @ b^T for [..., M, K] x [..., N, K] with equal batch axes (see `_mm`)."""
  return jnp.einsum("...ik,...jk->...ij", a, b)


def _mm_nt_fwd(a, b):
  return _mm_nt(a, b), (a, b)


def _mm_nt_bwd(res, g):
  a, b = res
  return g @ b, _transposed(g) @ a


_mm_nt.defvjp(_mm_nt_fwd, _mm_nt_bwd)


def _exp_masked(x, mask):
  """exp(x) where mask, else 0, without evaluating exp on masked entries."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _runs(segment_ids):
  """Forward-filled run structure of [B, T] segment ids.

  Returns (run_seg, run_index, start): the segment a token's run belongs to
  (padding joins the run before it; leading padding is run segment 0), a
  per-row run counter, and where runs start.
  """
  b, t = segment_ids.shape
  pos = jnp.arange(t)[None, :]
  last_valid = jax.lax.cummax(jnp.where(segment_ids > 0, pos, -1), axis=1)
  run_seg = jnp.where(
      last_valid >= 0,
      jnp.take_along_axis(segment_ids, jnp.maximum(last_valid, 0), axis=1), 0)
  prev = jnp.concatenate(
      [jnp.full((b, 1), -1, run_seg.dtype), run_seg[:, :-1]], axis=1)
  start = run_seg != prev
  run_index = jnp.cumsum(start, axis=1) - 1
  return run_seg, run_index, start


class ChunkDecays(NamedTuple):
  """Per-chunk decay factors and score matrices (all exponents <= 0)."""

  read: jax.Array  # [..., C, K] exp(G_i): token i reads the chunk-start state
  to_end: jax.Array  # [..., C, K] exp(G_last - G_j), within the last run
  total: jax.Array  # [..., K] exp(G_last)
  a_kk: jax.Array  # [..., C, C] strictly lower k_i.(exp(G_i - G_j) k_j)
  a_qk: jax.Array  # [..., C, C] lower (incl. diagonal) q_i.(exp(G_i - G_j) k_j)
  G: jax.Array | None  # [..., C, K] run-restarting cumulative decay (segments)


def _block_sums(tot, relation):
  """sum of whole-block totals tot [..., NB, K] over blocks l with relation.

  `relation(n, m, l)` is a boolean over block indices; the result is indexed
  [..., n, m, K] (use m = n for one-index relations). Multiplying by a 0/1
  mask and adding is exact, so these are true range sums.
  """
  nb = tot.shape[-2]
  i = jnp.arange(nb)
  mask = relation(i[:, None, None], i[None, :, None], i[None, None, :])
  return jnp.einsum("nml,...lk->...nmk", mask.astype(tot.dtype), tot,
                    precision=_HIGHEST)


def _intra_chunk(q, k, g, run, starts, segmented, bounded, sub):
  """Decays and masked score matrices for all chunks at once.

  Cut each chunk into NB = C / S blocks (S = `sub`). With incl[i] the sum of
  g over [block start, i] and after[j] the sum over (j, block end], a pair
  j < i with i in block n and j in an earlier block m factors exactly into
  three exponents, each <= 0:

      G_i - G_j = incl[i] + (sum of the whole blocks between m and n) + after[j]

  Inside a block, when every |incl| <= 80 (always under a lower-bound gate:
  S * |bound|), the pair factors as exp(incl[i]) exp(-incl[j]), both finite
  in float32. So the rows of block n are (q | k) * exp(incl), and its columns
  are k_j * exp(between + after[j]) left of the block and k_j * exp(-incl[j])
  inside it: all scores of block n are one [2S, K] x [K, C] matmul, batched
  over blocks and chunks (the [NB, C, K] column tensor is the only copy).
  When the decays are unbounded (pre-activated or softplus gates) and some
  |incl| > 80, a runtime branch computes the diagonal blocks with the exact
  masked exponent on [NB, 16, 16, K] instead.

  Args:
    q, k, g: [..., C, K] (q scaled); g the log decay (<= 0).
    run: [..., C] run index per token (segmented only).
    starts: [..., C] bool, token starts a run (segmented only).
    segmented: static; False means one run per chunk.
    bounded: static; True when a lower-bound gate keeps sub * |g| <= 80.
    sub: static block size (see `block_size`).

  Returns:
    ChunkDecays.
  """
  c, kd = k.shape[-2:]
  nb = c // sub
  batch = g.shape[:-2]
  blocks = lambda x: x.reshape(batch + (nb, sub, x.shape[-1]))
  incl = _range_sums(g, sub, lambda i, j: j <= i)  # [..., C, K]
  after = _range_sums(g, sub, lambda i, j: j > i)
  tot = incl[..., sub - 1::sub, :]  # [..., NB, K] whole-block sums

  row = jnp.exp(incl)
  q_row, k_row = q * row, k * row
  rows = jnp.concatenate([blocks(q_row), blocks(k_row)], axis=-2)  # 2S rows
  col = jnp.exp(after)
  if nb > 1:  # columns of earlier blocks, as seen from each row block
    bi = jnp.arange(nb)
    between = _block_sums(tot, lambda n, m, l: (m < l) & (l < n))
    mid = _exp_masked(between, (bi[:, None] > bi[None, :])[..., None])
    earlier = mid[..., :, :, None, :] * blocks(k * col)[..., None, :, :, :]
    on_diag = (bi[:, None] == bi[None, :])[:, :, None, None]

  def scores(diag_cols):
    # cols[n, m]: the columns of block m as seen from the rows of block n
    cols = diag_cols
    if nb > 1:
      cols = jnp.where(on_diag, diag_cols[..., None, :, :, :], earlier)
    a = _mm_nt(rows, cols.reshape(batch + (nb, c, kd)))  # [..., NB, 2S, C]
    return (a[..., :sub, :].reshape(batch + (c, c)),
            a[..., sub:, :].reshape(batch + (c, c)))

  def factored(_):
    return scores(blocks(k * jnp.exp(-incl)))  # <= exp(80)

  def exact(_):
    a_qk, a_kk = scores(jnp.zeros(batch + (nb, sub, kd), k.dtype))
    gb, qb, kb = blocks(g), blocks(q), blocks(k)
    s = jnp.arange(sub)
    # pair[s, t] = sum over (t, s] of g: cumsum over u of g_u 1[u > t].
    after_t = jnp.where((s[None, :] > s[:, None])[..., None],
                        gb[..., None, :, :], 0.0)  # [..., NB, t, u, K]
    pair = jnp.swapaxes(jax.lax.cumsum(after_t, axis=after_t.ndim - 2),
                        -2, -3)
    decay = _exp_masked(pair, (s[:, None] >= s[None, :])[..., None])
    d_qk = jnp.einsum("...sk,...tk,...stk->...st", qb, kb, decay)
    d_kk = jnp.einsum("...sk,...tk,...stk->...st", kb, kb, decay)
    place = lambda a, d: (a.reshape(batch + (nb, sub, nb, sub)) + jnp.where(
        jnp.eye(nb, dtype=bool)[:, None, :, None], d[..., :, :, None, :],
        0.0)).reshape(a.shape)
    return place(a_qk, d_qk), place(a_kk, d_kk)

  if bounded:
    a_qk, a_kk = factored(None)
  else:
    a_qk, a_kk = jax.lax.cond(jnp.min(incl) >= -_FACTOR_LIMIT, factored,
                              exact, None)
  i = jnp.arange(c)
  lower, strict = i[:, None] >= i[None, :], i[:, None] > i[None, :]
  if segmented:
    same = run[..., :, None] == run[..., None, :]  # [..., C, C]
    lower, strict = lower & same, strict & same
  a_qk = jnp.where(lower, a_qk, 0.0)
  a_kk = jnp.where(strict, a_kk, 0.0)

  # With one block the whole-block factors below are all exp(0): skipped, so
  # that the backward does not reduce their zero gradients.
  to_end = col
  if nb > 1:
    suffix = _block_sums(tot, lambda n, m, l: l > n)[..., 0, :]  # [..., NB, K]
    to_end = (blocks(col) * jnp.exp(suffix)[..., None, :]).reshape(g.shape)
  if segmented:
    G = _segmented_cumsum(g, (starts | (jnp.arange(c) == 0))[..., None],
                          axis=-2)
    read = jnp.exp(G)
    total = read[..., -1, :]
    in_last = (run == run[..., -1:])[..., None]
    to_end = jnp.where(in_last, to_end, 0.0)
  else:
    G = None
    read = row
    if nb > 1:
      prefix = _block_sums(tot, lambda n, m, l: l < n)[..., 0, :]
      read = (blocks(row) * jnp.exp(prefix)[..., None, :]).reshape(g.shape)
    total = jnp.exp(jnp.sum(tot, axis=-2))
  return ChunkDecays(read=read, to_end=to_end, total=total, a_kk=a_kk,
                     a_qk=a_qk, G=G)


def _to_blocks(full, size):
  """[..., C, C] -> [..., NB, NB, size, size] blocks (row block, col block)."""
  batch, c = full.shape[:-2], full.shape[-1]
  n = c // size
  return jnp.swapaxes(full.reshape(batch + (n, size, n, size)), -2, -3)


def _unit_triangular_solve(blk, rhs, lower):
  """(I + A)^-1 rhs for A strictly triangular, given as blocks.

  Args:
    blk: [..., NB, NB, S, S], blk[n, m] = A[n-th row block, m-th col block];
      A strictly lower (`lower`) or strictly upper.
    rhs: [..., NB * S, N].

  Blocked substitution: the S x S diagonal blocks are inverted by repeated
  squaring (six batched matmuls), then the block rows are solved in order
  (from the top when lower, from the bottom when upper), each with two
  matmuls. XLA's batched triangular_solve on CPU is far slower for many
  small systems.
  """
  nb, s = blk.shape[-3], blk.shape[-1]
  batch = blk.shape[:-4]
  diag = jnp.stack([blk[..., i, i, :, :] for i in range(nb)], axis=-3)
  # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8): L is strictly
  # triangular 16 x 16, so L^16 = 0 and the product telescopes to
  # (I - L^16)(I + L)^-1.
  eye = jnp.eye(s, dtype=blk.dtype)
  inv = eye - diag
  power = diag
  for _ in range(s.bit_length() - 2):
    power = power @ power
    inv = inv @ (eye + power)
  rb = rhs.reshape(batch + (nb, s, rhs.shape[-1]))
  xs = [None] * nb
  for i in (range(nb) if lower else reversed(range(nb))):
    r = rb[..., i, :, :]
    done = range(i) if lower else range(i + 1, nb)
    if done:
      left = jnp.swapaxes(blk[..., i, done[0]:done[-1] + 1, :, :], -2, -3)
      r = r - left.reshape(batch + (s, len(done) * s)) @ jnp.concatenate(
          [xs[m] for m in done], axis=-2)
    xs[i] = inv[..., i, :, :] @ r
  return jnp.concatenate(xs, axis=-2)


@jax.custom_vjp
def _ut_solve(a, rhs):
  """(I + A)^-1 rhs for A [..., C, C] strictly lower, rhs [..., C, N].

  Blocked forward substitution on 16 x 16 blocks. The VJP is the closed form
  d rhs = (I + A)^-T g (back substitution with the transposed blocks) and
  dA = -tril(d rhs out^T) (strictly lower): no autodiff through the blocks.
  """
  return _unit_triangular_solve(_to_blocks(a, SUB), rhs, lower=True)


def _ut_solve_fwd(a, rhs):
  out = _ut_solve(a, rhs)
  return out, (a, out)


def _ut_solve_bwd(res, g):
  a, out = res
  d_rhs = _unit_triangular_solve(_to_blocks(_transposed(a), SUB), g,
                                 lower=False)
  i = jnp.arange(a.shape[-1])
  d_a = jnp.where(i[:, None] > i[None, :], -_mm_nt(d_rhs, out), 0.0)
  return d_a, d_rhs


_ut_solve.defvjp(_ut_solve_fwd, _ut_solve_bwd)


def _ut_transform(qc, kc, vc, bc, dec):
  """The UT transform of every chunk.

  Args:
    qc, kc, vc: [..., C, K|V] chunked inputs (q scaled); bc: [..., C] beta.
    dec: the chunks' `ChunkDecays`.

  Returns:
    (wu, q_dec): [W | U] [..., C, K + V] with (I + A) [W | U] =
    Diag(beta) [exp(G) K | V], and q_dec = exp(G) * Q, which reads the
    chunk-start state.
  """
  rhs = jnp.concatenate([dec.read * kc, vc], axis=-1) * bc[..., None]
  # The solve always works on 16 x 16 blocks (its numerics do not depend on
  # how the scores were factored).
  return _ut_solve(dec.a_kk * bc[..., None], rhs), qc * dec.read


def _affine_maps(qc, kc, vc, bc, dec):
  """`_ut_transform` and each chunk's affine state map X_next = trans X + bias.

  Returns:
    (w, u, q_dec, trans, bias).
  """
  kd = kc.shape[-1]
  wu, q_dec = _ut_transform(qc, kc, vc, bc, dec)
  # (exp(G_C - G) K)^T as an array of its own (see `_mm`).
  k_end_wu = _mm(_transposed(kc * dec.to_end), wu)  # [..., K, K + V]
  trans = jnp.eye(kd, dtype=kc.dtype) * dec.total[..., None, :] - k_end_wu[
      ..., :kd]
  return wu[..., :kd], wu[..., kd:], q_dec, trans, k_end_wu[..., kd:]


# Chunk-heads x K per step of the grouped scan, in 64-token chunks: 16 chunks
# of K = 64 (1024 tokens x heads), a working set of a few MiB that stays in
# cache (see `_grouped_core`); smaller chunks take as many tokens a step.
_GROUP_WIDTH = 16 * 64


def group_size(num_chunks, batch_heads, head_dim, chunk=64):
  """(chunks per group, groups) of the grouped scan; groups * size >= chunks.

  About 1024 tokens x heads at K = 64 per group (16 chunk-heads of 64
  tokens; fewer when K is larger), sized so that padding the last group
  wastes less than one chunk per group.
  """
  width = _GROUP_WIDTH * 64 // chunk  # the same tokens per step at any chunk
  size = max(1, min(num_chunks, width // (batch_heads * head_dim)))
  groups = -(-num_chunks // size)
  return -(-num_chunks // groups), groups


def _grouped_core(q, k, v, g, beta, init, *, prep, block, chunk):
  """Raw inputs without segments -> (o [B,T,H,V] f32, finals [B,1,H,K,V]).

  The same chunk math as `_chunked_core`, computed group by group: a
  `lax.scan` over groups of `group_size` chunks (all heads and rows of the
  batch) carries the state [B * H, K, V] (`init` [B, H, K, V] float32).
  Inside a step, the group's tokens are prepared (`prep`: `common.prepare`
  on a slice; gates, L2 norm, casts), cut into chunks, their intra-chunk work
  is batched, the group's chunks update the state one after another
  (V_new = U - W X, then X' = exp(G_C) X + K_end^T V_new), and the outputs
  are read. A whole-sequence pass makes every intermediate
  ([.., C, C] scores, [.., C, K] factors) a DRAM round trip; per group they
  stay in cache, which on a CPU halves the forward. The step is
  `jax.checkpoint`ed: the backward recomputes a group from its inputs and
  carried state instead of storing every intermediate.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c = chunk
  sub, bounded = block
  gs, ng = group_size(-(-t // c), b * h, kd, c)
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
    dec = _intra_chunk(qc, kc, gc, None, None, False, bounded, sub)
    wu, q_dec = _ut_transform(qc, kc, vc, bc, dec)
    w, u = wu[..., :kd], wu[..., kd:]
    k_end = _transposed(kc * dec.to_end)  # [GS, B * H, K, C]
    # Per-chunk operands by one split each: its transpose is one concatenate
    # (indexing chunk by chunk would transpose to GS full-size pads and adds).
    per_chunk = lambda x: [y[0] for y in jax.lax.split(x, (1,) * gs)]
    ws, us, k_ends, totals = map(per_chunk, (w, u, k_end, dec.total))
    carried, v_new = [], []  # the state entering each chunk; its errors
    for j in range(gs):
      carried.append(state)
      v_new.append(us[j] - _mm(ws[j], state))
      state = totals[j][..., None] * state + _mm(k_ends[j], v_new[j])
    carried, v_new = jnp.stack(carried), jnp.stack(v_new)
    o = _mm(q_dec, carried) + _mm(dec.a_qk, v_new)
    o = jnp.transpose(o.reshape(gs, b, h, c, vd), (1, 0, 3, 2, 4))
    return state, o.reshape(b, span, h, vd)

  carry0 = common.vary_like(init.reshape(b * h, kd, vd), xs, init)
  last, o = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), carry0, xs)
  o = jnp.moveaxis(o, 0, 1).reshape(b, ng * span, h, vd)[:, :t]
  return o, last.reshape(b, 1, h, kd, vd)


def kda_chunked(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments."""
  prep = functools.partial(
      common.prepare, scale=scale, a_log=a_log, dt_bias=dt_bias,
      lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
      use_qk_l2norm=use_qk_l2norm, max_num_segments=max_num_segments)
  chunk = backends.chunk_size()
  block = block_size(lower_bound, use_gate_in_kernel, chunk)
  has_segments = segment_ids is not None
  if has_segments:
    cn = prep(q, k, v, g, beta, initial_state=initial_state,
              segment_ids=segment_ids)
    o, final = _chunked_core(
        cn.q, cn.k, cn.v, cn.g, cn.beta, cn.segment_ids, cn.initial_state,
        init_given=initial_state is not None,
        output_final_state=output_final_state, block=block, chunk=chunk)
  else:
    b, _, h, kd = q.shape
    init = (jnp.zeros((b, h, kd, v.shape[-1]), jnp.float32)
            if initial_state is None else initial_state.astype(jnp.float32))
    # Tokens are prepared group by group, inside the grouped scan.
    per_token = functools.partial(prep, initial_state=None, segment_ids=None)
    o, final = _grouped_core(q, k, v, g, beta, init, prep=per_token,
                             block=block, chunk=chunk)
  return common.finish(o, final, dtype=q.dtype, has_segments=has_segments,
                       output_final_state=output_final_state)


def _chunked_core(q, k, v, g, beta, segment_ids, init, *, init_given,
                  output_final_state, block, chunk):
  """Canonical float32 inputs with segments -> (o, finals [B,N,H,K,V]).

  All chunks at once: the intra-chunk work is batched over every chunk, the
  affine maps are scanned (resetting where a segment starts), then the
  outputs of all chunks are read in one batched pass.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  n_seg = init.shape[1]
  sub, bounded = block
  c = chunk
  nc = -(-t // c)
  pad = nc * c - t

  valid = segment_ids > 0
  # Padding is a no-op: no decay, no write, no read.
  zero = lambda x: jnp.where(valid[..., None, None], x, 0.0)
  q, k, v, g = zero(q), zero(k), zero(v), zero(g)
  beta = jnp.where(valid[..., None], beta, 0.0)
  if pad:
    pad_t = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(pad_t, (q, k, v, g, beta))
    segment_ids = pad_t(segment_ids)

  # [B, T, H, *] -> [B, NC, H, C, *]
  to_chunks = lambda x: jnp.moveaxis(
      x.reshape((b, nc, c) + x.shape[2:]), 3, 2)
  qc, kc, vc, gc = map(to_chunks, (q, k, v, g))
  bc = jnp.moveaxis(beta.reshape(b, nc, c, h), 3, 2)  # [B, NC, H, C]

  run_seg, run_index, start = _runs(segment_ids)
  per_chunk = lambda x: x.reshape(b, nc, 1, c)  # broadcast over H
  run_c, start_c, seg_c = map(per_chunk, (run_index, start, run_seg))
  # A token reads the carried state iff its run began before the chunk.
  cont = (run_c == run_c[..., :1]) & ~start_c[..., :1]  # [B, NC, 1, C]

  dec = _intra_chunk(qc, kc, gc, run_c, start_c, True, bounded, sub)
  a_qk = dec.a_qk
  w, u, q_dec, trans, bias = _affine_maps(qc, kc, vc, bc, dec)

  # Initial states of segments whose runs start inside a chunk.
  init0 = jnp.concatenate([jnp.zeros_like(init[:, :1]), init], axis=1)
  last_cont = cont[..., 0, -1]  # [B, NC]: chunk-end run began earlier
  last_seg = seg_c[..., 0, -1]  # [B, NC]
  init_last = jnp.take_along_axis(
      init0, last_seg[..., None, None, None], axis=1) if init_given else None

  def step(state, xs):
    trans_c, bias_c, keep, fresh = xs
    x = jnp.where(keep[:, None, None, None], state,
                  fresh if init_given else 0.0)
    return _mm(trans_c, x) + bias_c, state

  xs = [jnp.moveaxis(trans, 1, 0), jnp.moveaxis(bias, 1, 0),
        jnp.moveaxis(last_cont, 1, 0),
        jnp.moveaxis(init_last, 1, 0) if init_given
        else jnp.zeros((nc,), jnp.float32)]
  carry0 = jnp.zeros((b, h, kd, vd), jnp.float32)
  # carried[:, n]: the state entering chunk n (the end state of chunk n - 1).
  carry0 = common.vary_like(carry0, xs, init)
  _, carried = jax.lax.scan(step, carry0, xs)
  carried = jnp.moveaxis(carried, 0, 1)  # [B, NC, H, K, V]

  w_x, q_x = _mm(w, carried), _mm(q_dec, carried)
  cont_f = cont[..., None].astype(jnp.float32)
  w_x, q_x = w_x * cont_f, q_x * cont_f
  if init_given:
    # Tokens of runs that start inside the chunk read their own segment's
    # initial state: [.., C, K] x [B, N, H, K, V] selected per token.
    tok_seg = jnp.broadcast_to(seg_c, (b, nc, h, c))
    fresh = 1.0 - cont_f
    w_x = w_x + fresh * _read_init(w, init0, tok_seg)
    q_x = q_x + fresh * _read_init(q_dec, init0, tok_seg)
  v_new = u - w_x
  o = q_x + _mm(a_qk, v_new)

  o = jnp.moveaxis(o, 2, 3).reshape(b, nc * c, h, vd)[:, :t]
  o = jnp.where(valid[..., None, None], o, 0.0)

  finals = init
  if output_final_state:
    finals = _segment_finals(
        init, init0, run_index, run_seg, carried, dec.G, gc, kc, v_new, cont,
        run_c, init_given, n_seg)
  return o, finals


def _read_init(x, init0, tok_seg):
  """x [B,NC,H,C,K] times init0[seg of each token] [K,V] -> [B,NC,H,C,V]."""
  per_seg = jnp.einsum("bnhck,bshkv->bnhcsv", x, init0)
  return jnp.take_along_axis(
      per_seg, tok_seg[..., None, None], axis=-2)[..., 0, :]


def _segment_finals(init, init0, run_index, run_seg, carried, G, gc, kc, v_new,
                    cont, run_c, init_given, n_seg):
  """Final state of each segment: the state after the end of its last run."""
  b, nc, h, c, kd = kc.shape
  t_pad = nc * c
  pos = jnp.arange(t_pad)
  seg_ids = jnp.arange(1, n_seg + 1)
  # Last run of each segment, and the last position of that run.
  is_seg = run_seg[:, None, :] == seg_ids[None, :, None]  # [B, N, T]
  last_run = jnp.max(jnp.where(is_seg, run_index[:, None, :], -1), axis=-1)
  present = last_run >= 0  # [B, N]
  in_run = run_index[:, None, :] == last_run[..., None]
  end = jnp.max(jnp.where(in_run & present[..., None], pos, 0), axis=-1)
  chunk = end // c  # [B, N]
  e = end % c
  gather_chunk = lambda x: jnp.take_along_axis(
      x, chunk.reshape((b, -1) + (1,) * (x.ndim - 2)), axis=1)
  G_n, g_n, k_n, v_n, carried_n = map(
      gather_chunk, (G, gc, kc, v_new, carried))
  cont_n = gather_chunk(cont[:, :, 0])  # [B, N, C]
  run_n = gather_chunk(run_c[:, :, 0])  # [B, N, C]
  tok = jnp.arange(c)
  mine = (run_n == last_run[..., None]) & (tok[None, None, :] <= e[..., None])
  G_e = jnp.take_along_axis(G_n, e[:, :, None, None, None], axis=-2)
  upto_e = jnp.where((tok[None, None, :] <= e[..., None])[:, :, None, :, None],
                     g_n, 0.0)
  decay = _exp_masked(_range_sums(upto_e, c, lambda i, j: j > i),
                      mine[:, :, None, :, None])  # [B,N,H,C,K]: (j, e]
  write = jnp.einsum("bnhck,bnhcv->bnhkv", k_n * decay, v_n)
  e_cont = jnp.take_along_axis(cont_n, e[..., None], axis=-1)[..., 0]
  x = jnp.where(e_cont[..., None, None, None], carried_n,
                init0[:, 1:] if init_given else 0.0)
  final = jnp.exp(G_e[..., 0, :])[..., None] * x + write
  return jnp.where(present[..., None, None, None], final, init)

