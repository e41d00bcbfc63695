"""Chunked KDA in XLA: the WY / UT-transform form, exact for any decay.

Kimi Linear (arXiv 2510.26692, §3.2). Split the sequence into chunks of
C = 64 tokens. Inside a chunk, with incoming state X and G_i the cumulative
log decay from the chunk start up to and including token i:

    A[i, j]   = beta_i sum_d k_id k_jd exp(G_id - G_jd)      (j < i)
    M         = (I + A)^-1 Diag(beta)                        (unit lower solve)
    W = M (exp(G) * K),   U = M V                            (the UT transform)
    V_new     = U - W X                                      (delta-rule errors)
    O         = (Q * exp(G)) X + tril(A_qk) V_new,  A_qk[i, j] = q_i . (exp(G_i - G_j) * k_j)
    X_next    = exp(G_C) * X + (exp(G_C - G) * K)^T V_new

X_next is affine in X: X_next = T_c X + R_c with T_c = Diag(exp(G_C)) -
(exp(G_C - G) K)^T W and R_c = (exp(G_C - G) K)^T U. All intra-chunk work is
batched over every chunk at once; only the affine maps are scanned (one K x K
by K x V matmul per chunk), and the outputs are then computed for all chunks
in one batched pass from the chunk-start states.

Numerics. Nothing overflows at any decay (a chunk of 64 tokens at
lower_bound=-5 spans -320; pre-activated decays may go to -1000 and below):
exp(G_i - G_j) is never split as exp(G_i) exp(-G_j) over a chunk, and every
exponent is a sum of g over its own range (never a difference of two long
cumulative sums, which would lose ulp(G) of absolute precision). The chunk is
cut into blocks of S tokens (`block_size`: 16; 32 or 64 under a lower-bound
gate above -5, where S * |lower_bound| <= 80). A pair in different blocks
factors exactly into three exponents, each <= 0: within the row's block, the
whole blocks between, and within the column's block, so the off-diagonal
scores are einsums of [C, K] factors. Inside a block the pair factors as
exp(incl_i) exp(-incl_j) when |incl| <= 80 (always under a lower-bound gate);
otherwise a runtime branch uses the exact masked exponent on [16, 16, K].
Range sums are matmuls with 0/1 matrices (`_range_sums`); the unit lower
solve always uses 16 x 16 blocks. Accumulation is float32 throughout.
Measured against a float64 recurrence: ~2e-7 relative L2.

Packed segments (see `common`): a run of a segment may start anywhere inside a
chunk. Cumulative decays restart at each run start, A and A_qk are masked to
pairs in the same run, tokens of a run that started before the chunk read the
carried state, and tokens of a run that starts inside it read their segment's
initial state.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.ops.kda import common

CHUNK = 64
SUB = 16  # block size when the decays are unbounded (or bounded below -5)
# exp(-x) is finite in float32 for x <= 88; 16 tokens at -5 give 80.
_FACTOR_LIMIT = 80.0
_HIGHEST = jax.lax.Precision.HIGHEST


def block_size(lower_bound, use_gate_in_kernel) -> tuple[int, bool]:
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
  for size in (CHUNK, CHUNK // 2):
    if size * abs(lower_bound) <= _FACTOR_LIMIT:
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


def _range_sums(x, relation):
  """y[i] = sum of x[j] over the tokens j with relation(i, j), x [..., S, K].

  A matmul with a 0/1 matrix: each output is the float32 sum of exactly its
  range (HIGHEST precision: no reduced-precision passes on GPU/TPU). On CPU
  this is several times faster than `lax.cumsum`, which XLA lowers to a
  quadratic reduce-window, and its transpose is another such matmul.
  """
  i = jnp.arange(x.shape[-2])
  mask = relation(i[:, None], i[None, :]).astype(x.dtype)
  return jnp.einsum("ij,...jk->...ik", mask, x, precision=_HIGHEST)


def _sum_upto(x):
  """y[i] = sum of x[j] for j <= i along axis -2 (inclusive cumsum)."""
  return _range_sums(x, lambda i, j: j <= i)


def _sum_after(x):
  """y[i] = sum of x[j] for j > i along axis -2 (exclusive reverse cumsum)."""
  return _range_sums(x, lambda i, j: j > i)


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
  a_kk: jax.Array  # [..., NB, NB, S, S] strictly lower k_i.(exp(G_i - G_j) k_j)
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
  return jnp.einsum("nml,...lk->...nmk", mask.astype(tot.dtype), tot)


def _intra_chunk(q, k, g, run, starts, segmented, bounded, sub):
  """Decays and masked score matrices for all chunks at once.

  Cut each chunk into NB = C / S blocks (S = `sub`). With incl[i] the sum of
  g over [block start, i] and after[j] the sum over (j, block end], a pair j < i in
  different blocks m < n factors exactly into three exponents, each <= 0:

      G_i - G_j = incl[i] + (sum of the whole blocks between m and n) + after[j]

  so the off-diagonal scores are one einsum of [C, K] factors. Inside a block,
  when every |incl| <= 80 (always under a lower-bound gate: S * |bound|), the pair
  factors as exp(incl[i]) exp(-incl[j]), both finite in float32; otherwise
  (pre-activated or softplus decays that can be huge) a runtime branch uses
  the exact masked exponent on [NB, 16, 16, K].

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
  gb, qb, kb = blocks(g), blocks(q), blocks(k)
  incl = _sum_upto(gb)  # [..., NB, S, K]
  after = _sum_after(gb)
  tot = incl[..., -1, :]  # [..., NB, K]

  row = jnp.exp(incl)
  q_row, k_row = qb * row, kb * row
  col = jnp.exp(after)
  k_col = kb * col
  between = _block_sums(tot, lambda n, m, l: (m < l) & (l < n))
  lower_blocks = jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :]
  mid = _exp_masked(between, lower_blocks[..., None])  # [..., NB, NB, K]
  off = lambda rows: jnp.einsum("...nsk,...nmk,...mtk->...nmst", rows, mid,
                                k_col)

  s = jnp.arange(sub)
  incl_mask = s[:, None] >= s[None, :]
  strict_mask = s[:, None] > s[None, :]
  if segmented:
    same = run[..., :, None] == run[..., None, :]  # [..., C, C]
    same_b = jnp.stack(
        [same[..., i * sub:(i + 1) * sub, i * sub:(i + 1) * sub]
         for i in range(nb)], axis=-3)  # [..., NB, S, S]
    incl_mask, strict_mask = incl_mask & same_b, strict_mask & same_b

  def factored(_):
    k_inv = kb * jnp.exp(-incl)  # <= exp(80)
    d_qk = jnp.einsum("...nsk,...ntk->...nst", q_row, k_inv)
    d_kk = jnp.einsum("...nsk,...ntk->...nst", k_row, k_inv)
    return jnp.where(incl_mask, d_qk, 0.0), jnp.where(strict_mask, d_kk, 0.0)

  def exact(_):
    # pair[s, t] = sum over (t, s] of g: cumsum over u of g_u 1[u > t].
    after_t = jnp.where((s[None, :] > s[:, None])[..., None],
                        gb[..., None, :, :], 0.0)  # [..., NB, t, u, K]
    pair = jnp.swapaxes(jax.lax.cumsum(after_t, axis=after_t.ndim - 2),
                        -2, -3)
    decay = _exp_masked(pair, incl_mask[..., None])  # [..., NB, S, S, K]
    d_qk = jnp.einsum("...sk,...tk,...stk->...st", qb, kb, decay)
    d_kk = jnp.einsum("...sk,...tk,...stk->...st", kb, kb, decay)
    return d_qk, jnp.where(strict_mask, d_kk, 0.0)

  if bounded:
    d_qk, d_kk = factored(None)
  else:
    d_qk, d_kk = jax.lax.cond(jnp.min(incl) >= -_FACTOR_LIMIT, factored,
                              exact, None)
  on_diag = jnp.eye(nb, dtype=bool)[:, :, None, None]
  with_diag = lambda o, d: jnp.where(on_diag, d[..., :, None, :, :], o)
  # [..., NB, NB, S, S] blocks (n, m): rows of block n, columns of block m
  if nb == 1:  # the whole chunk is one block: nothing off the diagonal
    a_qk, a_kk = d_qk[..., :, None, :, :], d_kk[..., :, None, :, :]
  else:
    a_qk = with_diag(off(q_row), d_qk)
    a_kk = with_diag(off(k_row), d_kk)
  a_qk = jnp.swapaxes(a_qk, -2, -3).reshape(batch + (c, c))

  suffix = _block_sums(tot, lambda n, m, l: l > n)[..., 0, :]  # [..., NB, K]
  to_end = col * jnp.exp(suffix)[..., None, :]
  if segmented:
    a_qk = jnp.where(same, a_qk, 0.0)
    same_blocks = jnp.swapaxes(same.reshape(same.shape[:-2] + (nb, sub, nb, sub)),
                               -2, -3)
    a_kk = jnp.where(same_blocks, a_kk, 0.0)
    G = _segmented_cumsum(g, (starts | (jnp.arange(c) == 0))[..., None],
                          axis=-2)
    read = jnp.exp(G)
    total = read[..., -1, :]
    in_last = (run == run[..., -1:])[..., None]
    to_end = jnp.where(in_last, to_end.reshape(g.shape), 0.0)
  else:
    G = None
    prefix = _block_sums(tot, lambda n, m, l: l < n)[..., 0, :]
    read = (row * jnp.exp(prefix)[..., None, :]).reshape(g.shape)
    total = jnp.exp(jnp.sum(tot, axis=-2))
    to_end = to_end.reshape(g.shape)
  return ChunkDecays(read=read, to_end=to_end, total=total, a_kk=a_kk,
                     a_qk=a_qk, G=G)


def _reblock(blk, size):
  """[..., NB, NB, S, S] blocks of a C x C matrix -> blocks of `size`."""
  nb, s = blk.shape[-3], blk.shape[-1]
  if s == size:
    return blk
  batch, c = blk.shape[:-4], nb * s
  full = jnp.swapaxes(blk, -2, -3).reshape(batch + (c, c))
  n = c // size
  return jnp.swapaxes(full.reshape(batch + (n, size, n, size)), -2, -3)


def _unit_lower_solve(blk, rhs):
  """Solves (I + A) x = rhs, A strictly lower, given as blocks.

  Args:
    blk: [..., NB, NB, S, S], blk[n, m] = A[n-th row block, m-th col block].
    rhs: [..., C, M].

  Blocked forward substitution: the S x S diagonal blocks are inverted by
  repeated squaring (six batched matmuls), then the block rows are solved in
  order with matmuls. XLA's batched triangular_solve on CPU is far slower for
  many small systems, and a row-by-row loop makes a long backward graph.
  """
  nb = blk.shape[-3]
  batch = blk.shape[:-4]
  diag = jnp.stack([blk[..., i, i, :, :] for i in range(nb)], axis=-3)
  # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8): L is strictly lower
  # 16 x 16, so L^16 = 0 and the product telescopes to (I - L^16)(I + L)^-1.
  eye = jnp.eye(SUB, dtype=blk.dtype)
  inv = eye - diag
  power = diag
  for _ in range(3):
    power = power @ power
    inv = inv @ (eye + power)
  rb = rhs.reshape(batch + (nb, SUB, rhs.shape[-1]))
  xs = []
  for i in range(nb):
    r = rb[..., i, :, :]
    if i:
      done = jnp.concatenate(xs, axis=-2)  # [..., i * S, M]
      left = jnp.swapaxes(blk[..., i, :i, :, :], -2, -3).reshape(
          batch + (SUB, i * SUB))
      r = r - left @ done
    xs.append(inv[..., i, :, :] @ r)
  return jnp.concatenate(xs, axis=-2)


def kda_chunked(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments."""
  cn = common.prepare(
      q, k, v, g, beta, scale=scale, a_log=a_log, dt_bias=dt_bias,
      lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
      use_qk_l2norm=use_qk_l2norm, initial_state=initial_state,
      segment_ids=segment_ids, max_num_segments=max_num_segments)
  o, final = _chunked_core(
      cn.q, cn.k, cn.v, cn.g, cn.beta, cn.segment_ids, cn.initial_state,
      segmented=cn.has_segments,
      init_given=initial_state is not None and cn.has_segments,
      output_final_state=output_final_state,
      block=block_size(lower_bound, use_gate_in_kernel))
  return common.finish(o, final, dtype=q.dtype, has_segments=cn.has_segments,
                       output_final_state=output_final_state)


def _chunked_core(q, k, v, g, beta, segment_ids, init, *, segmented,
                  init_given, output_final_state, block):
  """Canonical float32 inputs -> (o [B,T,H,V] f32, finals [B,N,H,K,V])."""
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  n_seg = init.shape[1]
  sub, bounded = block
  c = CHUNK
  nc = -(-t // c)
  pad = nc * c - t

  valid = segment_ids > 0
  if segmented:
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

  if segmented:
    run_seg, run_index, start = _runs(segment_ids)
    per_chunk = lambda x: x.reshape(b, nc, 1, c)  # broadcast over H
    run_c, start_c, seg_c = map(per_chunk, (run_index, start, run_seg))
    # A token reads the carried state iff its run began before the chunk.
    cont = (run_c == run_c[..., :1]) & ~start_c[..., :1]  # [B, NC, 1, C]
  else:
    run_c = start_c = None

  dec = _intra_chunk(qc, kc, gc, run_c, start_c, segmented, bounded, sub)
  a_qk = dec.a_qk

  # UT transform: (I + A) [W | U] = Diag(beta) [exp(G) K | V].
  rhs = jnp.concatenate([dec.read * kc, vc], axis=-1) * bc[..., None]
  beta_rows = bc.reshape(bc.shape[:-1] + (c // SUB, 1, SUB, 1))
  # The solve always works on 16 x 16 blocks (its numerics do not depend on
  # how the scores were factored).
  wu = _unit_lower_solve(_reblock(dec.a_kk, SUB) * beta_rows, rhs)
  w, u = wu[..., :kd], wu[..., kd:]
  q_dec = qc * dec.read  # reads the chunk-start state

  # Decay from each token to the chunk end, within the chunk's last run.
  k_end = kc * dec.to_end
  # X_next = trans X + bias: trans [B,NC,H,K,K], bias [B,NC,H,K,V]
  k_end_wu = jnp.einsum("...ck,...cj->...kj", k_end, wu)
  trans = jnp.eye(kd) * dec.total[..., None, :] - k_end_wu[..., :kd]
  bias = k_end_wu[..., kd:]

  if segmented:
    # Initial states of segments whose runs start inside a chunk.
    init0 = jnp.concatenate([jnp.zeros_like(init[:, :1]), init], axis=1)
    last_cont = cont[..., 0, -1]  # [B, NC]: chunk-end run began earlier
    last_seg = seg_c[..., 0, -1]  # [B, NC]
    init_last = jnp.take_along_axis(
        init0, last_seg[..., None, None, None], axis=1) if init_given else None
  else:
    init0 = None

  def step(state, xs):
    trans_c, bias_c, *rest = xs
    x = state
    if segmented:
      keep, fresh = rest
      x = jnp.where(keep[:, None, None, None], state,
                    fresh if init_given else 0.0)
    return jnp.einsum("bhkj,bhjv->bhkv", trans_c, x) + bias_c, state

  xs = [jnp.moveaxis(trans, 1, 0), jnp.moveaxis(bias, 1, 0)]
  if segmented:
    xs += [jnp.moveaxis(last_cont, 1, 0),
           jnp.moveaxis(init_last, 1, 0) if init_given
           else jnp.zeros((nc,), jnp.float32)]
    carry0 = jnp.zeros((b, h, kd, vd), jnp.float32)
  else:
    carry0 = init[:, 0]
  # carried[:, n]: the state entering chunk n (the end state of chunk n - 1).
  carry0 = common.vary_like(carry0, xs, init)
  last_state, carried = jax.lax.scan(step, carry0, xs)
  carried = jnp.moveaxis(carried, 0, 1)  # [B, NC, H, K, V]

  w_x, q_x = jnp.einsum("rbnhck,bnhkv->rbnhcv", jnp.stack([w, q_dec]),
                        carried)
  if segmented:
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
  o = q_x + jnp.einsum("...ij,...jv->...iv", a_qk, v_new)

  o = jnp.moveaxis(o, 2, 3).reshape(b, nc * c, h, vd)[:, :t]
  if segmented:
    o = jnp.where(valid[..., None, None], o, 0.0)

  finals = init
  if output_final_state:
    if segmented:
      finals = _segment_finals(
          init, init0, run_index, run_seg, carried, dec.G, gc, kc, v_new, cont,
          run_c, init_given, n_seg)
    else:
      finals = last_state[:, None]
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
  decay = _exp_masked(_sum_after(upto_e),
                      mine[:, :, None, :, None])  # [B,N,H,C,K]: (j, e]
  write = jnp.einsum("bnhck,bnhcv->bnhkv", k_n * decay, v_n)
  e_cont = jnp.take_along_axis(cont_n, e[..., None], axis=-1)[..., 0]
  x = jnp.where(e_cont[..., None, None, None], carried_n,
                init0[:, 1:] if init_given else 0.0)
  final = jnp.exp(G_e[..., 0, :])[..., None] * x + write
  return jnp.where(present[..., None, None, None], final, init)

