"""The chunk pieces: block sizes, decays and scores, the UT transform.

`intra_chunk` computes a chunk's cumulative decays and its A (key-key) and
A_qk (query-key) scores, blocked so that no exponent overflows;
`ut_transform` turns them into W and U; `affine_maps` into the chunk's
affine state map (used with packed segments). See `chunked/__init__.py`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.ops.kda.chunked import linalg

SUB = linalg.SUB  # block size when the decays are unbounded


# exp(-x) is finite in float32 for x <= 88; 16 tokens at -5 give 80.
FACTOR_LIMIT = 80.0


class Tiling(NamedTuple):
  """How the chunked form cuts a sequence (static; `chunked.kda_chunked`)."""

  chunk: int  # C tokens per chunk
  sub: int  # S tokens per block inside a chunk (`block_size`)
  bounded: bool  # a lower-bound gate keeps S * |g| <= 80 (`block_size`)
  group_width: int  # chunk-heads x K per grouped-scan step (`group_size`)


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
    if size >= SUB and size * abs(lower_bound) <= FACTOR_LIMIT:
      return size, True
  return SUB, True


class ChunkDecays(NamedTuple):
  """Per-chunk decay factors and score matrices (all exponents <= 0)."""

  read: jax.Array  # [..., C, K] exp(G_i): token i reads the chunk-start state
  to_end: jax.Array  # [..., C, K] exp(G_last - G_j), within the last run
  total: jax.Array  # [..., K] exp(G_last)
  a_kk: jax.Array  # [..., C, C] strictly lower k_i.(exp(G_i - G_j) k_j)
  a_qk: jax.Array  # [..., C, C] lower (incl. diagonal) q_i.(exp(G_i - G_j) k_j)
  G: jax.Array | None  # [..., C, K] run-restarting cumulative decay (segments)


def intra_chunk(q, k, g, *, sub, bounded, precision, run=None, starts=None):
  """Decays and masked score matrices for all chunks at once.

  Cut each chunk into NB = C / S blocks (S = `sub`). With incl[i] the sum of
  g over [block start, i] and after[j] the sum over (j, block end], a pair
  j < i with i in block n and j in an earlier block m factors exactly into
  three exponents, each <= 0:

      G_i - G_j = incl[i] + (sum of the whole blocks between m and n) + after[j]

  Inside a block, when every |incl| <= 80 (always under a lower-bound gate:
  S * |bound|), the pair factors as exp(incl[i] - h) exp(h - incl[j]) with
  h = tot / 2 the middle of the block's range, both factors within exp(+-40)
  (so neither overflows, nor turns a small q or k entry subnormal, which
  XLA:CPU flushes to zero). So the rows of block n are
  (q | k) * exp(incl - h_n), and its columns are
  k_j * exp(h_n + between + after[j]) left of the block and
  k_j * exp(h_n - incl[j]) inside it: all scores of block n are one [2S, K] x [K, C] matmul, batched
  over blocks and chunks (the [NB, C, K] column tensor is the only copy).
  When the decays are unbounded (pre-activated or softplus gates) and some
  |incl| > 80, a runtime branch computes the diagonal blocks with the exact
  masked exponent on [NB, 16, 16, K] instead.

  Args:
    q, k, g: [..., C, K] (q scaled); g the log decay (<= 0).
    sub: static block size (see `block_size`).
    bounded: static; True when a lower-bound gate keeps sub * |g| <= 80.
    precision: the `lax.Precision` of the score products.
    run: [..., C] run index per token with packed segments; None: one run
      per chunk.
    starts: [..., C] bool, token starts a run (with `run`).

  Returns:
    ChunkDecays.
  """
  incl = linalg.range_sums(g, sub, lambda i, j: j <= i)  # [..., C, K]
  after = linalg.range_sums(g, sub, lambda i, j: j > i)
  tot = incl[..., sub - 1::sub, :]  # [..., NB, K] whole-block sums
  a_qk, a_kk = _block_scores(q, k, g, incl, after, tot, sub=sub,
                             bounded=bounded, precision=precision)
  c = k.shape[-2]
  i = jnp.arange(c)
  lower, strict = i[:, None] >= i[None, :], i[:, None] > i[None, :]
  if run is not None:
    same = run[..., :, None] == run[..., None, :]  # [..., C, C]
    lower, strict = lower & same, strict & same
  a_qk = jnp.where(lower, a_qk, 0.0)
  a_kk = jnp.where(strict, a_kk, 0.0)
  read, to_end, total, G = _decays(g, incl, after, tot, sub=sub, run=run,
                                   starts=starts)
  return ChunkDecays(read=read, to_end=to_end, total=total, a_kk=a_kk,
                     a_qk=a_qk, G=G)


def _blocks(x, sub):
  """[..., C, X] -> [..., C / sub, sub, X]."""
  return x.reshape(x.shape[:-2] + (x.shape[-2] // sub, sub, x.shape[-1]))


def _block_scores(q, k, g, incl, after, tot, *, sub, bounded, precision):
  """Unmasked (a_qk, a_kk) [..., C, C], one matmul per row block.

  Centred factors: rows exp(incl - half), diagonal-block columns
  exp(half - incl), half = tot / 2 the middle of the block's range, so both
  stay within exp(+-40) and a small q or k entry times its factor stays a
  normal float (XLA:CPU flushes subnormals to zero; uncentred, exp(-80)
  times an entry below 6.5e-4 is subnormal and the score loses it). Blocks
  spanning more than 80 take the exact diagonal (`_exact_diagonal`); there
  the clamp keeps every row factor <= exp(40).
  """
  half = jnp.maximum(0.5 * tot, -0.5 * FACTOR_LIMIT)  # [..., NB, K]
  centred = (_blocks(incl, sub) - half[..., None, :]).reshape(incl.shape)
  row = jnp.exp(centred)
  rows = jnp.concatenate([_blocks(q * row, sub), _blocks(k * row, sub)],
                         axis=-2)  # [..., NB, 2S, K]
  earlier = _earlier_columns(k, after, tot, half, sub)

  def factored(_):
    return _scores(rows, _blocks(k * jnp.exp(-centred), sub), earlier, sub,
                   precision)

  def exact(_):
    zeros = jnp.zeros(k.shape[:-2] + (k.shape[-2] // sub, sub, k.shape[-1]),
                      k.dtype)
    a_qk, a_kk = _scores(rows, zeros, earlier, sub, precision)
    d_qk, d_kk = _exact_diagonal(q, k, g, sub, precision)
    return _add_diagonal(a_qk, d_qk, sub), _add_diagonal(a_kk, d_kk, sub)

  if bounded:
    return factored(None)
  return jax.lax.cond(jnp.min(incl) >= -FACTOR_LIMIT, factored, exact, None)


def _earlier_columns(k, after, tot, half, sub):
  """[..., NB, NB, S, K]: block m's columns as seen from row block n > m.

  Row block n's factors carry exp(-half_n), so its columns take exp(+half_n)
  (an exponent <= 0, like the whole blocks between). None for one block.
  """
  nb = k.shape[-2] // sub
  if nb == 1:
    return None
  bi = jnp.arange(nb)
  between = linalg.block_sums(tot, lambda n, m, l: (m < l) & (l < n))
  mid = linalg.exp_masked(between + half[..., :, None, :],
                          (bi[:, None] > bi[None, :])[..., None])
  return (mid[..., :, :, None, :]
          * _blocks(k * jnp.exp(after), sub)[..., None, :, :, :])


def _scores(rows, diag_cols, earlier, sub, precision):
  """(a_qk, a_kk) from row factors and the diagonal blocks' columns."""
  nb, kd = diag_cols.shape[-3], diag_cols.shape[-1]
  batch, c = rows.shape[:-3], nb * sub
  cols = diag_cols  # cols[n, m]: block m's columns seen from row block n
  if earlier is not None:
    bi = jnp.arange(nb)
    on_diag = (bi[:, None] == bi[None, :])[:, :, None, None]
    cols = jnp.where(on_diag, diag_cols[..., None, :, :, :], earlier)
  a = linalg.mm_nt(rows, cols.reshape(batch + (nb, c, kd)),
                   precision)  # [..., NB, 2S, C]
  return (a[..., :sub, :].reshape(batch + (c, c)),
          a[..., sub:, :].reshape(batch + (c, c)))


def _exact_diagonal(q, k, g, sub, precision):
  """Diagonal blocks (d_qk, d_kk) [..., NB, S, S] by the masked exponent."""
  qb, kb = _blocks(q, sub), _blocks(k, sub)
  s = jnp.arange(sub)
  pair = linalg.pair_sums(g, sub)  # [..., NB, s, t, K]: g summed over (t, s]
  decay = linalg.exp_masked(pair, (s[:, None] >= s[None, :])[..., None])
  d_qk = jnp.einsum("...sk,...tk,...stk->...st", qb, kb, decay,
                    precision=precision)
  d_kk = jnp.einsum("...sk,...tk,...stk->...st", kb, kb, decay,
                    precision=precision)
  return d_qk, d_kk


def _add_diagonal(a, d, sub):
  """a [..., C, C] plus the blocks d [..., NB, S, S] on its diagonal."""
  nb = d.shape[-3]
  batch = a.shape[:-2]
  eye = jnp.eye(nb, dtype=bool)[:, None, :, None]
  return (a.reshape(batch + (nb, sub, nb, sub))
          + jnp.where(eye, d[..., :, :, None, :], 0.0)).reshape(a.shape)


def _decays(g, incl, after, tot, *, sub, run, starts):
  """(read, to_end, total, G) of `ChunkDecays` (G None without runs).

  With one block the whole-block factors are all exp(0): skipped, so that
  the backward does not reduce their zero gradients.
  """
  c = g.shape[-2]
  nb = c // sub
  to_end = jnp.exp(after)
  if nb > 1:
    suffix = linalg.block_sums(tot, lambda n, m, l: l > n)[..., 0, :]
    to_end = (_blocks(to_end, sub)
              * jnp.exp(suffix)[..., None, :]).reshape(g.shape)
  if run is not None:
    G = linalg.segmented_cumsum(
        g, (starts | (jnp.arange(c) == 0))[..., None], axis=-2)
    read = jnp.exp(G)
    in_last = (run == run[..., -1:])[..., None]
    return read, jnp.where(in_last, to_end, 0.0), read[..., -1, :], G
  read = jnp.exp(incl)
  if nb > 1:
    prefix = linalg.block_sums(tot, lambda n, m, l: l < n)[..., 0, :]
    read = (_blocks(read, sub) * jnp.exp(prefix)[..., None, :]).reshape(
        g.shape)
  return read, to_end, jnp.exp(jnp.sum(tot, axis=-2)), None


def ut_transform(qc, kc, vc, bc, dec, precision):
  """The UT transform of every chunk.

  Args:
    qc, kc, vc: [..., C, K|V] chunked inputs (q scaled); bc: [..., C] beta.
    dec: the chunks' `ChunkDecays`.
    precision: the op's `Precisions` (the solve's is used).

  Returns:
    (wu, q_dec): [W | U] [..., C, K + V] with (I + A) [W | U] =
    Diag(beta) [exp(G) K | V], and q_dec = exp(G) * Q, which reads the
    chunk-start state.
  """
  rhs = jnp.concatenate([dec.read * kc, vc], axis=-1) * bc[..., None]
  # The solve always works on 16 x 16 blocks (its numerics do not depend on
  # how the scores were factored).
  return (linalg.ut_solve(dec.a_kk * bc[..., None], rhs, precision.solve),
          qc * dec.read)


def affine_maps(qc, kc, vc, bc, dec, precision):
  """`ut_transform` and each chunk's affine state map X_next = trans X + bias.

  `precision`: the op's `Precisions` (the map is a state product).

  Returns:
    (w, u, q_dec, trans, bias).
  """
  kd = kc.shape[-1]
  wu, q_dec = ut_transform(qc, kc, vc, bc, dec, precision)
  # (exp(G_C - G) K)^T as an array of its own (see `linalg.mm`).
  k_end_wu = linalg.mm(linalg.transposed(kc * dec.to_end), wu,
                       precision.state)  # [..., K, K + V]
  trans = jnp.eye(kd, dtype=kc.dtype) * dec.total[..., None, :] - k_end_wu[
      ..., :kd]
  return wu[..., :kd], wu[..., kd:], q_dec, trans, k_end_wu[..., kd:]
