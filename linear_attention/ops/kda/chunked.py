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

Numerics. Every exponent used is <= 0, so nothing overflows at any decay (a
chunk of 64 tokens at lower_bound=-5 spans -320; pre-activated decays may go
to -1000 and below). exp(G_i - G_j) is never split as exp(G_i) exp(-G_j).
The chunk is cut into 16-token sub-blocks; for a row block starting at a, all
earlier columns j < a factor exactly as exp(G_i - G_a) * exp(G_a - G_j), both
factors <= 1, so those entries are one matmul; the 16 x 16 diagonal blocks use
the exact masked exponent. Accumulation is float32 throughout.

Packed segments (see `common`): a run of a segment may start anywhere inside a
chunk. Cumulative decays restart at each run start, A and A_qk are masked to
pairs in the same run, tokens of a run that started before the chunk read the
carried state, and tokens of a run that starts inside it read their segment's
initial state.
"""

import jax
import jax.numpy as jnp

from linear_attention.ops.kda import common

CHUNK = 64
SUB = 16


def _segmented_cumsum(x, starts, axis):
  """Cumulative sum along `axis` that restarts where `starts` is True."""

  def combine(a, b):
    fa, va = a
    fb, vb = b
    return fa | fb, jnp.where(fb, vb, va + vb)

  starts = jnp.broadcast_to(starts, x.shape)
  return jax.lax.associative_scan(combine, (starts, x), axis=axis)[1]


def _sum_after(x, axis):
  """y[j] = sum of x[t] for t > j along `axis` (exclusive reverse cumsum)."""
  x = jnp.moveaxis(x, axis, -1)
  shifted = jnp.concatenate([x[..., 1:], jnp.zeros_like(x[..., :1])], -1)
  total = jax.lax.cumsum(shifted, axis=shifted.ndim - 1, reverse=True)
  return jnp.moveaxis(total, -1, axis)


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


def _intra_chunk(q, k, g, run, starts, segmented):
  """Intra-chunk decays and masked score matrices for all chunks at once.

  Args:
    q, k, g: [..., C, K] (q scaled); g the log decay (<= 0).
    run: [..., C] run index per token (only used when segmented).
    starts: [..., C] bool, token starts a run (only used when segmented).
    segmented: static; False means one run per chunk.

  Returns:
    G [..., C, K] cumulative log decay (restarting at run starts),
    A_kk [..., C, C] strictly lower, A_qk [..., C, C] lower incl. diagonal,
  """
  c, kd = k.shape[-2:]
  nb = c // SUB
  if segmented:
    first = jnp.arange(c) == 0
    G = _segmented_cumsum(g, (starts | first)[..., None], axis=-2)
    same = run[..., :, None] == run[..., None, :]
  else:
    G = jnp.cumsum(g, axis=-2)
    same = None

  idx = jnp.arange(c)
  anchor = (idx // SUB) * SUB  # first row of each token's sub-block
  batch = G.shape[:-2]
  gb = g.reshape(batch + (nb, SUB, kd))

  # Off-diagonal sub-blocks: exp(G_i - G_j) = exp(G_i - G_a) exp(G_a - G_j).
  # Each exponent is summed over its own range of g (never a difference of
  # two long cumulative sums, which loses ulp(G) of absolute precision).
  row_sum = jnp.cumsum(gb.at[..., 0, :].set(0.0), axis=-2)  # (a, i]
  row_ok = jnp.ones((c,), bool) if same is None else same[..., idx, anchor]
  row_decay = _exp_masked(row_sum.reshape(g.shape), row_ok[..., None])
  k_row, q_row = k * row_decay, q * row_decay
  anchors = jnp.arange(nb) * SUB
  col_ok = idx[None, :] < anchors[:, None]  # [NB, C]: j < a
  # sum over (j, a] of g, for each anchor a: [..., NB, C, K]
  upto_a = jnp.where((idx[None, :] <= anchors[:, None])[..., None],
                     g[..., None, :, :], 0.0)
  col_sum = _sum_after(upto_a, axis=-2)
  if same is not None:
    col_ok = col_ok & same[..., ::SUB, :]
  col_decay = _exp_masked(col_sum, col_ok[..., None])
  k_col = k[..., None, :, :] * col_decay
  shape_rows = batch + (nb, SUB, kd)
  a_kk = jnp.einsum("...nsk,...nck->...nsc", k_row.reshape(shape_rows), k_col)
  a_qk = jnp.einsum("...nsk,...nck->...nsc", q_row.reshape(shape_rows), k_col)
  a_kk = a_kk.reshape(batch + (c, c))
  a_qk = a_qk.reshape(batch + (c, c))

  # Diagonal sub-blocks: exact masked exponent on [NB, SUB, SUB, K].
  kb = k.reshape(batch + (nb, SUB, kd))
  qb = q.reshape(batch + (nb, SUB, kd))
  s = jnp.arange(SUB)
  # pair_sum[s, t] = sum over (t, s] of g: cumsum over u of g_u 1[u > t].
  after_t = jnp.where((s[None, :] > s[:, None])[..., None],
                      gb[..., None, :, :], 0.0)  # [..., NB, t, u, K]
  pair_sum = jnp.swapaxes(jnp.cumsum(after_t, axis=-2), -2, -3)
  lower_incl = s[:, None] >= s[None, :]
  if same is not None:
    same_b = jnp.stack(
        [same[..., i * SUB:(i + 1) * SUB, i * SUB:(i + 1) * SUB]
         for i in range(nb)], axis=-3)  # [..., NB, SUB, SUB]
    lower_incl = lower_incl & same_b
  diag_decay = _exp_masked(pair_sum, lower_incl[..., None])  # [.., NB, S, S, K]
  d_qk = jnp.einsum("...sk,...tk,...stk->...st", qb, kb, diag_decay)
  d_kk = jnp.einsum("...sk,...tk,...stk->...st", kb, kb, diag_decay)
  d_kk = d_kk * (s[:, None] > s[None, :])
  a_qk = a_qk + _block_diag(d_qk, nb, c)
  a_kk = a_kk + _block_diag(d_kk, nb, c)
  return G, a_kk, a_qk


def _block_diag(blocks, nb, c):
  """[..., NB, S, S] -> [..., C, C] with the blocks on the diagonal."""
  batch = blocks.shape[:-3]
  eye = jnp.eye(nb, dtype=blocks.dtype)
  full = jnp.einsum("...nst,nm->...nsmt", blocks, eye)
  return full.reshape(batch + (c, c))


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
      output_final_state=output_final_state)
  return common.finish(o, final, dtype=q.dtype, has_segments=cn.has_segments,
                       output_final_state=output_final_state)


def _chunked_core(q, k, v, g, beta, segment_ids, init, *, segmented,
                  init_given, output_final_state):
  """Canonical float32 inputs -> (o [B,T,H,V] f32, finals [B,N,H,K,V])."""
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  n_seg = init.shape[1]
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

  G, a_kk, a_qk = _intra_chunk(qc, kc, gc, run_c, start_c, segmented)
  a_kk = a_kk * bc[..., :, None]

  # UT transform: (I + A) [W | U] = Diag(beta) [exp(G) K | V].
  eg = jnp.exp(G)
  rhs = jnp.concatenate([eg * kc, vc], axis=-1) * bc[..., None]
  wu = jax.lax.linalg.triangular_solve(
      a_kk, rhs, left_side=True, lower=True, unit_diagonal=True)
  w, u = wu[..., :kd], wu[..., kd:]
  q_dec = qc * eg  # reads the chunk-start state

  # Decay from each token to the chunk end, within the chunk's last run.
  G_last = G[..., -1:, :]
  if segmented:
    in_last = (run_c == run_c[..., -1:])[..., None]
  else:
    in_last = jnp.ones((1,), bool)
  k_end = kc * _exp_masked(_sum_after(gc, axis=-2), in_last)
  trans = (jnp.eye(kd) * jnp.exp(G_last[..., 0, :])[..., None, :]
           - jnp.einsum("...ck,...cj->...kj", k_end, w))  # [B,NC,H,K,K]
  bias = jnp.einsum("...ck,...cv->...kv", k_end, u)  # [B,NC,H,K,V]

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
  last_state, carried = jax.lax.scan(step, carry0, xs)
  carried = jnp.moveaxis(carried, 0, 1)  # [B, NC, H, K, V]

  w_x = jnp.einsum("bnhck,bnhkv->bnhcv", w, carried)
  q_x = jnp.einsum("bnhck,bnhkv->bnhcv", q_dec, carried)
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
          init, init0, run_index, run_seg, carried, G, gc, kc, v_new, cont,
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
  decay = _exp_masked(_sum_after(upto_e, axis=-2),
                      mine[:, :, None, :, None])  # [B,N,H,C,K]: (j, e]
  write = jnp.einsum("bnhck,bnhcv->bnhkv", k_n * decay, v_n)
  e_cont = jnp.take_along_axis(cont_n, e[..., None], axis=-1)[..., 0]
  x = jnp.where(e_cont[..., None, None, None], carried_n,
                init0[:, 1:] if init_given else 0.0)
  final = jnp.exp(G_e[..., 0, :])[..., None] * x + write
  return jnp.where(present[..., None, None, None], final, init)

