"""Adapter to tokamax's Pallas/Mosaic TPU KDA kernel.

tokamax 0.0.17 (`tokamax.ops.kimi_delta_attention(implementation="mosaic")`)
is head-first: q, k, g [H, B, T, K], v [H, B, T, V], beta [H, B, T], states
[B, N, H, K, V]. This file transposes our [B, T, H, *] layout in and out and
turns the kernel's limits into `NotImplementedError`s that name them:

* TPU v6 or newer, or CPU inside `linear_attention.testing.mosaic_interpret_mode()`;
* float32 or bfloat16 inputs; K <= 256; chunk size 64;
* without `segment_ids`, T must be a multiple of 64;
* the fused gate needs `lower_bound` (tokamax's safe-gate form); the softplus
  gate must be activated by the caller (`use_gate_in_kernel=False`), and then
  its numerical range is the caller's responsibility: the kernel factors
  exp(G_i - G_j) around the middle of 16-token sub-chunks, so per-token log
  decays far below -5 can overflow inside it.

With packed segments, tokamax 0.0.17's backward returns NaN gradients at
padding positions (segment id 0) and for the initial states of segments that
have no token in a row (measured: H=1, T=100, K=V=32, two segments, trailing
padding). Its forward is right there, so this adapter keeps the op's contract
around it: padding tokens are no-ops, so their gradients are zero; a segment
absent from a row has its initial state as final state, so that gradient is
passed straight through. Both are selects, which drop the NaN cotangents.
"""

import jax
import jax.numpy as jnp

from linear_attention import testing

MAX_KEY_DIM = 256
CHUNK = 64


def _check_supported(q, v, *, use_gate_in_kernel, lower_bound, segment_ids):
  b, t, h, kd = q.shape
  if jax.default_backend() != "tpu" and not testing.mosaic_interpret_active():
    raise NotImplementedError(
        "backend='mosaic' runs tokamax's Pallas kernel, which needs a TPU v6+;"
        f" the default device is {jax.default_backend()}. On CPU, call it"
        " inside `linear_attention.testing.mosaic_interpret_mode()` (Pallas"
        " interpret mode), or use backend='chunked'.")
  if q.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != q.dtype:
    raise NotImplementedError(
        "backend='mosaic' supports float32 and bfloat16 q/k/v of one dtype;"
        f" got q {q.dtype}, v {v.dtype}.")
  if kd > MAX_KEY_DIM:
    raise NotImplementedError(
        f"backend='mosaic' supports K <= {MAX_KEY_DIM}; got K={kd}.")
  if segment_ids is None and t % CHUNK:
    raise NotImplementedError(
        f"backend='mosaic' needs T to be a multiple of {CHUNK} without"
        f" segment_ids; got T={t}. Pass segment_ids (padding = 0) instead.")
  if use_gate_in_kernel and lower_bound is None:
    raise NotImplementedError(
        "backend='mosaic' fuses only the lower-bound gate (lower_bound in"
        " [-5, 0)); activate the softplus gate first and pass"
        " use_gate_in_kernel=False.")


def kda_mosaic(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments."""
  # Imported lazily: tokamax's Pallas TPU modules are only needed here.
  from tokamax._src.ops.kda import api as tokamax_kda  # pylint: disable=g-import-not-at-top

  _check_supported(q, v, use_gate_in_kernel=use_gate_in_kernel,
                   lower_bound=lower_bound, segment_ids=segment_ids)
  head_first = lambda x: jnp.moveaxis(x, 2, 0)  # [B,T,H,*] -> [H,B,T,*]
  dtype = q.dtype
  k, v, g = k.astype(dtype), v.astype(dtype), g.astype(dtype)
  beta = beta.astype(dtype)
  present = None
  if segment_ids is not None:
    # Padding is a no-op: route no cotangent into tokamax's there.
    valid = (segment_ids > 0)[:, :, None]
    detach_pad = lambda x: jnp.where(
        valid.reshape(valid.shape + (1,) * (x.ndim - 3)), x,
        jax.lax.stop_gradient(x))
    q, k, v, g, beta = map(detach_pad, (q, k, v, g, beta))
  if initial_state is not None:
    initial_state = initial_state.astype(jnp.float32)
    if segment_ids is None:
      initial_state = initial_state[:, None]  # [B, 1, H, K, V]
    else:
      ids = jnp.arange(1, initial_state.shape[1] + 1)
      present = jnp.any(segment_ids[:, None, :] == ids[None, :, None],
                        axis=-1)[:, :, None, None, None]  # [B, N, 1, 1, 1]
      given_state = initial_state
      initial_state = jnp.where(present, initial_state,
                                jax.lax.stop_gradient(initial_state))
  o, final_state = tokamax_kda.kimi_delta_attention(
      head_first(q), head_first(k), head_first(v), head_first(g),
      jnp.moveaxis(beta, 2, 0),
      a_log=None if a_log is None else a_log.astype(jnp.float32),
      delta_time_bias=None if dt_bias is None else dt_bias.astype(jnp.float32),
      scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
      use_gate_in_kernel=use_gate_in_kernel,
      segment_ids=None if segment_ids is None else segment_ids.astype(
          jnp.int32),
      lower_bound=lower_bound,
      # tokamax sizes its segment tables by max_num_segments even without
      # states; T bounds the number of runs in a row.
      max_num_segments=(max_num_segments if max_num_segments is not None
                        or segment_ids is None else q.shape[1]),
      implementation="mosaic")
  o = jnp.moveaxis(o, 0, 2).astype(dtype)
  if not output_final_state:
    return o, None
  final_state = final_state.astype(jnp.float32)
  if segment_ids is None:
    final_state = final_state[:, 0]
  elif present is not None:
    final_state = jnp.where(present, final_state, given_state)
  return o, final_state
