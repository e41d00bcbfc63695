"""The packed-segment schedules: chunk math with runs starting anywhere.

A run of a segment may start anywhere inside a chunk; see
`chunked/__init__.py` (Packed segments) and `ops/kda/common.py`. Two
schedules of the same math:

* `packed_core` (no final states: training): a checkpointed `lax.scan`
  over groups of chunks, like the dense `grouped.dense_core`; memory
  grows with T by the carried state per group only;
* `packed_core_with_finals` (final states): every chunk's intra-chunk work
  batched at once, then the affine state maps scanned; the per-segment
  final states read the carried state of any chunk. Its temporaries grow
  with the number of chunks times the state (5.6 GiB at T=8192, H=32,
  K=V=128), so it is used only where final states are asked for.
"""

import jax
import jax.numpy as jnp

from linear_attention.ops.kda import common
from linear_attention.ops.kda.chunked import grouped
from linear_attention.ops.kda.chunked import intra
from linear_attention.ops.kda.chunked import linalg


def _chunks(q, k, v, g, beta, segment_ids, nc, c):
  """Padding made a no-op, the sequence padded to `nc` chunks of `c` tokens.

  Returns (valid [B, T], (qc, kc, vc, gc) [B, NC, H, C, *], bc [B, NC, H, C],
  (run_seg, run_index) [B, NC * C] (see `common.segment_runs`), and per chunk (run_c,
  start_c, seg_c, cont) [B, NC, 1, C], cont: a token reads the carried state
  (its run began before the chunk)).
  """
  b, t, h, _ = q.shape
  valid = segment_ids > 0
  # Padding is a no-op: no decay, no write, no read (it joins the run before).
  zero = lambda x: jnp.where(valid[..., None, None], x, 0.0)
  q, k, v, g = zero(q), zero(k), zero(v), zero(g)
  beta = jnp.where(valid[..., None], beta, 0.0)
  pad = nc * c - t
  if pad:
    pad_t = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(pad_t, (q, k, v, g, beta))
    segment_ids = pad_t(segment_ids)
  # [B, T, H, *] -> [B, NC, H, C, *]
  to_chunks = lambda x: jnp.moveaxis(
      x.reshape((b, nc, c) + x.shape[2:]), 3, 2)
  qkvg = tuple(map(to_chunks, (q, k, v, g)))
  bc = jnp.moveaxis(beta.reshape(b, nc, c, h), 3, 2)
  run_seg, run_index, start = common.segment_runs(segment_ids)
  per_chunk = lambda x: x.reshape(b, nc, 1, c)  # broadcast over H
  run_c, start_c, seg_c = map(per_chunk, (run_index, start, run_seg))
  cont = (run_c == run_c[..., :1]) & ~start_c[..., :1]
  return valid, qkvg, bc, (run_seg, run_index), (run_c, start_c, seg_c, cont)


def packed_core_with_finals(q, k, v, g, beta, segment_ids, init, *,
                            init_given, tiling, precision):
  """Canonical inputs with segments -> (o, finals [B,N,H,K,V]).

  All chunks at once: the intra-chunk work is batched over every chunk, the
  affine maps are scanned (resetting where a segment starts), then the
  outputs of all chunks are read in one batched pass.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  n_seg = init.shape[1]
  c = tiling.chunk
  nc = -(-t // c)
  valid, (qc, kc, vc, gc), bc, (run_seg, run_index), per_chunk = _chunks(
      q, k, v, g, beta, segment_ids, nc, c)
  run_c, start_c, seg_c, cont = per_chunk

  dec = intra.intra_chunk(qc, kc, gc, run=run_c, starts=start_c,
                          sub=tiling.sub, bounded=tiling.bounded,
                          precision=precision.scores)
  a_qk = dec.a_qk
  w, u, q_dec, trans, bias = intra.affine_maps(qc, kc, vc, bc, dec,
                                               precision)

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
    return linalg.mm(trans_c, x, precision.state) + bias_c, state

  xs = [jnp.moveaxis(trans, 1, 0), jnp.moveaxis(bias, 1, 0),
        jnp.moveaxis(last_cont, 1, 0),
        jnp.moveaxis(init_last, 1, 0) if init_given
        else jnp.zeros((nc,), q.dtype)]
  carry0 = jnp.zeros((b, h, kd, vd), q.dtype)
  # carried[:, n]: the state entering chunk n (the end state of chunk n - 1).
  carry0 = common.vary_like(carry0, xs, init)
  _, carried = jax.lax.scan(step, carry0, xs)
  carried = jnp.moveaxis(carried, 0, 1)  # [B, NC, H, K, V]

  w_x = linalg.mm(w, carried, precision.state)
  q_x = linalg.mm(q_dec, carried, precision.state)
  cont_f = cont[..., None].astype(q.dtype)
  w_x, q_x = w_x * cont_f, q_x * cont_f
  if init_given:
    # Tokens of runs that start inside the chunk read their own segment's
    # initial state: [.., C, K] x [B, N, H, K, V] selected per token.
    tok_seg = jnp.broadcast_to(seg_c, (b, nc, h, c))
    fresh = 1.0 - cont_f
    w_x = w_x + fresh * _read_init(w, init0, tok_seg, precision.state)
    q_x = q_x + fresh * _read_init(q_dec, init0, tok_seg, precision.state)
  v_new = u - w_x
  o = q_x + linalg.mm(a_qk, v_new, precision.output)

  o = jnp.moveaxis(o, 2, 3).reshape(b, nc * c, h, vd)[:, :t]
  o = jnp.where(valid[..., None, None], o, 0.0)

  finals = _segment_finals(
      init, init0, run_index, run_seg, carried, dec.G, gc, kc, v_new, cont,
      run_c, init_given, n_seg, precision.state)
  return o, finals


def packed_core(q, k, v, g, beta, segment_ids, init, *, init_given, tiling,
                precision):
  """Canonical inputs with segments -> o, group by group (no final states).

  The math of `packed_core_with_finals`, in a `jax.checkpoint`ed `lax.scan` over
  groups of `grouped.group_size` chunks carrying the state [B, H, K, V]
  that enters the group: inside a step the group's intra-chunk work is
  batched, its chunks' affine maps applied one after another, and its
  outputs read; the backward recomputes a group from its inputs.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  c = tiling.chunk
  gs, ng = grouped.group_size(-(-t // c), b * h, kd, c, tiling.group_width)
  nc = gs * ng
  valid, qkvg, bc, _, per_chunk = _chunks(q, k, v, g, beta, segment_ids, nc,
                                          c)
  # [B, NC, ...] -> [NG, B, GS, ...]
  by_group = lambda x: jnp.moveaxis(x.reshape((b, ng, gs) + x.shape[2:]), 1,
                                    0)
  xs = tuple(map(by_group, (*qkvg, bc, *per_chunk)))
  init0 = jnp.concatenate([jnp.zeros_like(init[:, :1]), init], axis=1)

  def step(state, group):
    qg, kg, vg, gg, bg, run_g, start_g, seg_g, cont_g = group
    dec = intra.intra_chunk(qg, kg, gg, run=run_g, starts=start_g,
                            sub=tiling.sub, bounded=tiling.bounded,
                            precision=precision.scores)
    w, u, q_dec, trans, bias = intra.affine_maps(qg, kg, vg, bg, dec,
                                                 precision)
    keep = cont_g[:, :, 0, -1]  # [B, GS]: chunk-end run began earlier
    if init_given:
      fresh = jnp.take_along_axis(
          init0, seg_g[:, :, 0, -1][..., None, None, None], axis=1)
    carried = []  # the state entering each chunk of the group
    for j in range(gs):
      carried.append(state)
      x = jnp.where(keep[:, j, None, None, None], state,
                    fresh[:, j] if init_given else 0.0)
      state = linalg.mm(trans[:, j], x, precision.state) + bias[:, j]
    carried = jnp.stack(carried, axis=1)  # [B, GS, H, K, V]
    cont_f = cont_g[..., None].astype(qg.dtype)
    w_x = linalg.mm(w, carried, precision.state) * cont_f
    q_x = linalg.mm(q_dec, carried, precision.state) * cont_f
    if init_given:
      tok_seg = jnp.broadcast_to(seg_g, (b, gs, h, c))
      w_x = w_x + (1.0 - cont_f) * _read_init(w, init0, tok_seg,
                                              precision.state)
      q_x = q_x + (1.0 - cont_f) * _read_init(q_dec, init0, tok_seg,
                                              precision.state)
    o = q_x + linalg.mm(dec.a_qk, u - w_x,
                        precision.output)  # [B, GS, H, C, V]
    return state, jnp.moveaxis(o, 2, 3).reshape(b, gs * c, h, vd)

  carry0 = common.vary_like(jnp.zeros((b, h, kd, vd), q.dtype), xs, init)
  _, o = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), carry0, xs)
  o = jnp.moveaxis(o, 0, 1).reshape(b, nc * c, h, vd)[:, :t]
  return jnp.where(valid[..., None, None], o, 0.0)


def _read_init(x, init0, tok_seg, precision):
  """x [B,NC,H,C,K] times init0[seg of each token] [K,V] -> [B,NC,H,C,V]."""
  per_seg = jnp.einsum("bnhck,bshkv->bnhcsv", x, init0, precision=precision)
  return jnp.take_along_axis(
      per_seg, tok_seg[..., None, None], axis=-2)[..., 0, :]


def _segment_finals(init, init0, run_index, run_seg, carried, G, gc, kc, v_new,
                    cont, run_c, init_given, n_seg, precision):
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
  decay = linalg.exp_masked(linalg.range_sums(upto_e, c, lambda i, j: j > i),
                      mine[:, :, None, :, None])  # [B,N,H,C,K]: (j, e]
  write = jnp.einsum("bnhck,bnhcv->bnhkv", k_n * decay, v_n,
                     precision=precision)
  e_cont = jnp.take_along_axis(cont_n, e[..., None], axis=-1)[..., 0]
  x = jnp.where(e_cont[..., None, None, None], carried_n,
                init0[:, 1:] if init_given else 0.0)
  final = jnp.exp(G_e[..., 0, :])[..., None] * x + write
  return jnp.where(present[..., None, None, None], final, init)
