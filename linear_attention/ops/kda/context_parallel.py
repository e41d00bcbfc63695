"""Context parallelism for KDA: exact state passing over a mesh axis.

Called inside `jax.shard_map` with T split over the mesh axis `context_axis`
(each rank holds a contiguous slice; rank order = sequence order), every rank
computes the global result on its own slice. Nothing of the sequence is
gathered; only states cross ranks.

Algorithm (backends "reference" and "chunked", whose `run` is `run` below;
the per-rank engine is the backend's own single-device runner, `local_fn`,
so the algorithm is exact and backend-agnostic). The delta rule
S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T is
affine in S_{t-1}; with v = 0 it is linear. Per rank r:

1. One local call with values [v | 0_K] (V + K columns) and initial state
   [0 | I_K] for the shard's first run gives, for the shard's last run, the
   end state with zero incoming state F_r (first V columns) and its K x K
   transition T_r (last K columns): end = T_r X + F_r. (T_r = 0 when the last
   run starts inside the shard.)
2. All-gather (T_r, F_r) and three ints per row (first and last valid
   segment id of the shard, whether it has a valid token): O(H K (K + V)).
3. Compose X_{r+1} = T_r X_r' + F_r over the ranks before this one, where
   X_r' is the carried state if rank r's first run continues the carried
   segment, else that segment's initial state; a shard with only padding
   passes the carried state (and its segment id) through.
4. A second local call, with X_r as the initial state of the shard's first
   run when it continues the previous non-empty shard's last segment, gives
   the exact outputs and the shard's final states.
5. Final state of segment n comes from the last rank holding a token of n
   (its initial state if no rank does); a psum of masked contributions gives
   every rank the global final states.

The shard's first run gets its own state slot (id N + 1) in both local calls,
so a segment id that reappears later in the shard still starts from its own
initial state. Gradients are exact by autodiff through `all_gather` and
`psum`, taken outside the `shard_map` (tested at 2, 4 and 8 ranks).

Works under `jax.shard_map`'s default `check_vma=True`: the backends start
their scan carries varying like their inputs (`ops/kda/common.vary_like`),
and the final states come out of psums, typed mesh-invariant, so
`out_specs=P()` is accepted for them.

Chunk-boundary states (`chunk_states`, the op's `output_chunk_states`) are
the same algebra on one device: the row is cut into pieces of C tokens laid
side by side as rows of one local call (step 1), and a `lax.scan` over the
pieces composes their maps (step 3), emitting the state at each piece's last
token. Under context parallelism each rank starts that scan from the state
its ranks before pass on.

Backend "tokamax" uses tokamax's own CP path instead
(`ops/kda/tokamax_kernel.py`, `kda_tokamax_context_parallel`).

Sequence layout: contiguous slices in rank order, the only one exact for a
recurrence (see `linear_attention.ops.context_axis`).
"""

import jax
import jax.numpy as jnp

from linear_attention.ops import context_axis as axes
from linear_attention.ops.kda import common

_HIGHEST = jax.lax.Precision.HIGHEST


def _runs(ids):
  """Run structure of [B, T] ids (see `ops/kda/common.py`).

  Returns (valid, run_index, first_id, last_id, last_pos): run_index counts
  runs from 1 at valid tokens; first/last_id are the ids of the first and
  last valid tokens (0 if none); last_pos the last valid position (or 0).
  """
  t = ids.shape[1]
  valid = ids != 0
  pos = jnp.arange(t, dtype=jnp.int32)[None, :]
  last_valid = jax.lax.cummax(jnp.where(valid, pos, -1), axis=1)
  prev_pos = jnp.pad(last_valid[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  prev_id = jnp.where(
      prev_pos >= 0,
      jnp.take_along_axis(ids, jnp.maximum(prev_pos, 0), axis=1), 0)
  starts = valid & (ids != prev_id)
  run_index = jnp.cumsum(starts.astype(jnp.int32), axis=1)
  first_pos = jnp.argmax(valid, axis=1)
  first_id = jnp.take_along_axis(ids, first_pos[:, None], axis=1)[:, 0]
  last_pos = jnp.maximum(last_valid[:, -1], 0)
  last_id = jnp.take_along_axis(ids, last_pos[:, None], axis=1)[:, 0]
  last_id = jnp.where(valid.any(axis=1), last_id, 0)
  return valid, run_index, first_id, last_id, last_pos


def _pick(states, slot):
  """states [B, N, ...], slot [B] -> [B, ...] (slot clipped into range)."""
  slot = jnp.clip(slot, 0, states.shape[1] - 1)
  idx = slot.reshape((-1, 1) + (1,) * (states.ndim - 2))
  return jnp.take_along_axis(states, idx, axis=1)[:, 0]


def _bmask(mask, x):
  """Broadcasts a [B] or [B, N] mask against x's leading axes."""
  return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def local_labels(ids, user_init, state_shape, dtype):
  """Segment labels of a slice for its local calls, and their base states.

  The slice's first run gets its own slot (the last, N + 1), so that its
  incoming state can be set apart from a later run of the same id. With
  `user_init` None (every state starts at zero, no final states wanted)
  only run boundaries matter: runs are labelled 1, 2, 1, 2, ... so that no
  bound on the ids is needed.

  Args:
    ids: [B, T] int32 ids (0 = padding).
    user_init: [B, N, H, K, V] initial states of ids 1..N, or None.
    state_shape: (H, K, V).
    dtype: the compute dtype.

  Returns:
    (labels [B, T] int32, base [B, N', H, K, V]): the labels, and the
    initial states of slots 1..N' (the first run's slot N' + 1 excluded).
  """
  valid, run_index, _, _, _ = _runs(ids)
  if user_init is None:
    base = jnp.zeros((ids.shape[0], 2) + tuple(state_shape), dtype)
    labels = jnp.where(valid, 1 + run_index % 2, 0)
  else:
    base, labels = user_init, ids
  first_run = valid & (run_index == 1)
  labels = jnp.where(first_run, base.shape[1] + 1, labels).astype(jnp.int32)
  return labels, base


def end_maps(q, k, v, g, beta, *, labels, base, local_fn, local):
  """Step 1: the end state of each row's last run, affine in the state
  entering its first run: end = trans @ X + offset.

  One local call with values [v | 0_K] and the first run's initial state
  [0 | I_K]. `labels`, `base` from `local_labels`; `local` holds the op's
  keyword arguments for `local_fn` (segment_ids=labels included).

  Returns:
    (trans [B, H, K, K], offset [B, H, K, V]); trans = 0 when the last run
    starts after the first.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  dtype = base.dtype
  n_user = base.shape[1]
  eye = jnp.broadcast_to(jnp.eye(kd, dtype=dtype), (b, 1, h, kd, kd))
  init1 = jnp.concatenate([
      jnp.concatenate([base, jnp.zeros((b, n_user, h, kd, kd), dtype)], -1),
      jnp.concatenate([jnp.zeros((b, 1, h, kd, vd), dtype), eye], -1),
  ], axis=1)
  v_aug = jnp.concatenate([v, jnp.zeros((b, t, h, kd), v.dtype)], axis=-1)
  _, end1 = local_fn(
      q, k, v_aug, g, beta, initial_state=init1, output_final_state=True,
      **local)
  last_pos = _runs(labels)[4]
  last_label = jnp.take_along_axis(labels, last_pos[:, None], axis=1)[:, 0]
  end = _pick(end1, last_label - 1)  # [B, H, K, V + K]
  return end[..., vd:], end[..., :vd]


def compose(carry, carry_id, trans, offset, first_id, last_id, has, init_of):
  """Step 3 for one slice: passes the carried (state, segment id) across it.

  The slice's first run continues the carried state if it has the carried
  id, else starts from its segment's initial state (`init_of(ids)`); a slice
  without valid tokens passes the carry through.

  Returns:
    (carry, carry_id, new): the carry after the slice, and the end state of
    its last run (meaningful where `has`).
  """
  cont = has & (first_id == carry_id) & (carry_id != 0)
  start = jnp.where(_bmask(cont, carry), carry, init_of(first_id))
  new = jnp.einsum("bhkj,bhjv->bhkv", trans, start,
                   precision=_HIGHEST) + offset
  carry = jnp.where(_bmask(has, carry), new, carry)
  carry_id = jnp.where(has, last_id, carry_id)
  return carry, carry_id, new


def chunk_states(q, k, v, g, beta, *, every, local_fn, local, initial_state,
                 segment_ids, dtype, carry=None):
  """The state after tokens every, 2 every, ... of each row.

  The row is cut into pieces of `every` tokens, laid side by side as rows of
  one local call that gives each piece's affine end map (step 1), and a scan
  over the pieces composes them (step 3). At each piece's last token the
  state is that of the segment holding the token; zeros if it is padding.
  Exact and differentiable like the rest (autodiff through the local call
  and the scan); it costs one extra local pass over the tokens with V + K
  value columns.

  Args:
    q, k, v, g, beta: the op's inputs ([B, T, ...], validated; T need not
      be a multiple of `every`: tokens after the last boundary are unused).
    every: C, the distance between boundaries.
    local_fn: the backend's single-device runner.
    local: the op's keyword arguments for `local_fn`; its state and segment
      arguments are replaced here.
    initial_state: [B, H, K, V] ([B, N, H, K, V] with segment_ids) or None.
    segment_ids: [B, T] ids or None.
    dtype: the compute dtype.
    carry: (state [B, H, K, V], segment id [B]) entering the row (context
      parallelism: what the ranks before this one pass on); None: nothing.

  Returns:
    [B, T // every, H, K, V] in `dtype`.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  n = t // every
  if n == 0:
    return common.vary_like(jnp.zeros((b, 0, h, kd, vd), dtype), q)
  ids = (segment_ids.astype(jnp.int32) if segment_ids is not None
         else jnp.ones((b, t), jnp.int32))

  def pieces(x):  # [B, T, ...] -> [B * n, every, ...], row-major in (B, n)
    return x[:, :n * every].reshape((b * n, every) + x.shape[2:])

  user_init = None
  if initial_state is not None:
    user_init = jnp.asarray(initial_state, dtype)
    if segment_ids is None:
      user_init = user_init[:, None]
  local = {n: x for n, x in local.items() if n not in (
      "initial_state", "output_final_state", "segment_ids",
      "max_num_segments")}
  piece_ids = pieces(ids)
  labels, base = local_labels(
      piece_ids, None if user_init is None else jnp.repeat(user_init, n, 0),
      (h, kd, vd), dtype)
  trans, offset = end_maps(
      *map(pieces, (q, k, v, g, beta)), labels=labels, base=base,
      local_fn=local_fn,
      local=dict(local, segment_ids=labels, max_num_segments=base.shape[1] + 1))
  _, _, first_id, last_id, _ = _runs(piece_ids)
  has = (piece_ids != 0).any(axis=1)
  ends_valid = piece_ids[:, -1] != 0

  def init_of(seg_id):
    if user_init is None:
      return jnp.zeros((b, h, kd, vd), dtype)
    return _pick(user_init, seg_id - 1)

  def step(c, x):
    state, state_id = c
    tr, off, first, last, has_j, end_j = x
    state, state_id, new = compose(state, state_id, tr, off, first, last,
                                   has_j, init_of)
    return (state, state_id), jnp.where(_bmask(end_j, new), new, 0.0)

  per_piece = lambda x: jnp.moveaxis(x.reshape((b, n) + x.shape[1:]), 1, 0)
  xs = tuple(map(per_piece, (trans, offset, first_id, last_id, has,
                             ends_valid)))
  if carry is None:
    carry = (jnp.zeros((b, h, kd, vd), dtype), jnp.zeros((b,), jnp.int32))
  carry = common.vary_like(carry, q)
  _, out = jax.lax.scan(step, carry, xs)  # [n, B, H, K, V]
  return jnp.moveaxis(out, 0, 1)


def run(local_fn, call: common.Call):
  """`call` on a backend's single-device runner `local_fn`: directly (with
  its chunk-boundary states when asked), or, under its context axis, by the
  exact state passing of this module. How the XLA backends run a call.

  `local_fn(q, k, v, g, beta, **call.op_kwargs()) -> (o, final_state)`.
  """
  kwargs = call.op_kwargs()
  xs = (call.q, call.k, call.v, call.g, call.beta)
  if call.context_axis is not None:
    return kda_context_parallel(
        *xs, context_axis=call.context_axis, local_fn=local_fn,
        chunk_states_every=(call.chunk_states_every
                            if call.output_chunk_states else None), **kwargs)
  out = local_fn(*xs, **kwargs)
  if not call.output_chunk_states:
    return out
  states = chunk_states(
      *xs, every=call.chunk_states_every, local_fn=local_fn, local=kwargs,
      initial_state=call.initial_state, segment_ids=call.segment_ids,
      dtype=common.compute_dtype(*xs, call.initial_state))
  return out + (states,)


def kda_context_parallel(
    q, k, v, g, beta, *, context_axis: str, local_fn, scale, a_log=None,
    dt_bias=None, lower_bound=None, use_gate_in_kernel=False,
    use_qk_l2norm=False, initial_state=None, output_final_state=False,
    segment_ids=None, max_num_segments=None, chunk_states_every=None,
):
  """KDA on a sequence shard; see the module docstring.

  Arguments are those of `ops.kimi_delta_attention` (already validated
  there), on this rank's slice of T: q, k, g [B, T_local, H, K], v
  [B, T_local, H, V], beta [B, T_local, H], segment_ids [B, T_local] (the
  slice of the global ids). initial_state and the returned final state are
  global ([B, H, K, V], or [B, N, H, K, V] with segment_ids), the same on
  every rank. `local_fn(q, k, v, g, beta, **kwargs) -> (o, state)` is the
  backend's single-device runner (the op's keyword arguments, validated).

  With `chunk_states_every` = C (T_local a multiple of C), also the states
  at this rank's boundaries (global positions C, 2 C, ... that fall in its
  slice; `chunk_states`).

  Returns:
    (o [B, T_local, H, V], final_state or None), like the op; with
    `chunk_states_every`, (o, final_state or None, [B, T_local / C, H, K, V]).
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  dtype = common.compute_dtype(q, k, v, g, beta, initial_state)
  has_segments = segment_ids is not None
  ids = (segment_ids.astype(jnp.int32) if has_segments
         else jnp.ones((b, t), jnp.int32))
  valid, _, first_id, last_id, last_pos = _runs(ids)
  has_valid = valid.any(axis=1)

  # Local labels: the shard's first run gets its own slot (the last one).
  user_init = _user_init(initial_state, output_final_state,
                         (b, max_num_segments if has_segments else 1, h, kd,
                          vd), dtype, has_segments=has_segments)
  labels, base = local_labels(ids, user_init, (h, kd, vd), dtype)
  n_user = base.shape[1]
  n_slots = n_user + 1

  def init_of(seg_id):  # the user's initial state of segment seg_id, [B,H,K,V]
    if user_init is None:
      return jnp.zeros((b, h, kd, vd), dtype)
    return _pick(user_init, seg_id - 1)

  local = dict(scale=scale, a_log=a_log, dt_bias=dt_bias,
               lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
               use_qk_l2norm=use_qk_l2norm, segment_ids=labels,
               max_num_segments=n_slots)

  # 1. End state of the shard's last run, affine in the incoming state.
  trans, offset = end_maps(q, k, v, g, beta, labels=labels, base=base,
                           local_fn=local_fn, local=local)

  # 2. Gather the affine maps and the shards' segment ends.
  trans_all = jax.lax.all_gather(trans, context_axis)  # [R, B, H, K, K]
  offset_all = jax.lax.all_gather(offset, context_axis)  # [R, B, H, K, V]
  meta = jnp.stack([first_id, last_id, has_valid.astype(jnp.int32)], axis=-1)
  meta_all = jax.lax.all_gather(meta, context_axis)  # [R, B, 3]

  # 3. Compose over the ranks before this one.
  x_in, id_in = _incoming(trans_all, offset_all, meta_all, init_of,
                          context_axis=context_axis, shape=(b, h, kd, vd),
                          dtype=dtype)

  boundary = None
  if chunk_states_every is not None:
    boundary = chunk_states(
        q, k, v, g, beta, every=chunk_states_every, local_fn=local_fn,
        local=local, initial_state=initial_state, segment_ids=segment_ids, dtype=dtype,
        carry=(x_in, id_in))
  extra = () if boundary is None else (boundary,)

  # 4. Exact local pass with the incoming state on the first run.
  cont = has_valid & (first_id == id_in) & (id_in != 0)
  first_state = jnp.where(_bmask(cont, x_in), x_in, init_of(first_id))
  init2 = jnp.concatenate([base, first_state[:, None]], axis=1)
  o, end2 = local_fn(
      q, k, v, g, beta, initial_state=init2,
      output_final_state=output_final_state, **local)
  if not output_final_state:
    return (o, None) + extra

  # 5. Final state of segment n from the last rank that holds a token of n.
  final = _global_finals(ids, labels, first_id, base, end2, user_init,
                         context_axis=context_axis)
  if not has_segments:
    final = common.without_segment_axis(final)
  return (o, final) + extra


def _user_init(initial_state, output_final_state, shape, dtype, *,
               has_segments):
  """The user's initial states with a segment axis [B, N, H, K, V].

  Zeros when only a final state is asked for; None when neither is.
  """
  if initial_state is None:
    return jnp.zeros(shape, dtype) if output_final_state else None
  init = jnp.asarray(initial_state, dtype)
  return init if has_segments else common.with_segment_axis(init)


def _incoming(trans_all, offset_all, meta_all, init_of, *, context_axis,
              shape, dtype):
  """(state, segment id) entering this rank: the ranks before it composed.

  `meta_all` [R, B, 3] holds each rank's (first id, last id, has a token).
  """
  rank = jax.lax.axis_index(context_axis)
  carry = jnp.zeros(shape, dtype)
  carry_id = jnp.zeros(shape[:1], jnp.int32)
  x_in, id_in = carry, carry_id
  for j in range(axes.axis_size(context_axis) - 1):
    first_j, last_j, has_j = (meta_all[j, :, i] for i in range(3))
    carry, carry_id, _ = compose(
        carry, carry_id, trans_all[j], offset_all[j], first_j, last_j,
        has_j.astype(bool), init_of)
    after_j = rank == j + 1
    x_in = jnp.where(after_j, carry, x_in)
    id_in = jnp.where(after_j, carry_id, id_in)
  return x_in, id_in


def _global_finals(ids, labels, first_id, base, end2, user_init, *,
                   context_axis):
  """[B, N, H, K, V]: segment n's final state, from the last rank holding n.

  `end2` is this rank's local pass's final states (the user's N slots, then
  the slot of the rank's first run); segments on no rank keep `user_init`.
  """
  n_user = base.shape[1]
  num_ranks = axes.axis_size(context_axis)
  rank = jax.lax.axis_index(context_axis)
  seg = jnp.arange(1, n_user + 1, dtype=jnp.int32)[None, :, None]
  present = jnp.any(ids[:, None, :] == seg, axis=-1)  # [B, N]
  later_run = jnp.any(labels[:, None, :] == seg, axis=-1)  # outside run 1
  use_first = (seg[..., 0] == first_id[:, None]) & ~later_run
  mine = jnp.where(_bmask(use_first, base), end2[:, n_user:],
                   end2[:, :n_user])
  present_all = jax.lax.all_gather(present, context_axis)  # [R, B, N]
  after = (jnp.arange(num_ranks) > rank)[:, None, None]
  owner = present & ~jnp.any(present_all & after, axis=0)
  final = jax.lax.psum(jnp.where(_bmask(owner, mine), mine, 0.0),
                       context_axis)
  # A psum (not the all-gathered `present_all`) so that `final` is typed
  # mesh-invariant, as out_specs=P() asks under check_vma=True.
  anywhere = jax.lax.psum(present.astype(jnp.int32), context_axis) > 0
  return final + jnp.where(_bmask(anywhere, base), 0.0, user_init)
