"""Backend "tokamax": tokamax's Pallas/Mosaic TPU KDA kernel behind the op
(the name "mosaic" is accepted for it), and the one file that touches
tokamax internals (`tokamax._src`, checked against tokamax 0.0.17).

tokamax 0.0.17 (`tokamax.ops.kimi_delta_attention(implementation="mosaic")`)
is head-first: q, k, g [H, B, T, K], v [H, B, T, V], beta [H, B, T], states
[B, N, H, K, V]. This file transposes our [B, T, H, *] layout in and out;
`supports` names the kernel's limits (the op raises them as
`NotImplementedError`, or "auto" passes over this backend):

* TPU v6 or newer (tokamax's `supported_on`; on a v5e, run with that check
  lifted, it keeps about three digits with float32 inputs, measured, so the
  v5e stays refused: `V5E_MEASURED`), real or the target of
  `mosaic.lowering_mode()` (exports it for a TPU, by JAX's abstract-mesh
  cross-lowering); on any device inside `mosaic.interpreted()` (the kernel
  in Pallas interpret mode, which
  `experiments.training.interpret.interpret_mode` sets up);
* float32 or bfloat16 inputs; K <= 256; chunk size 64; its own matmul
  precision (`precision="auto"` only); no chunk-boundary states;
* without `segment_ids`, T must be a multiple of 64 (a decode piece that is
  not runs on "chunked": `decode_fallback`);
* the fused gate needs `lower_bound` (tokamax's safe-gate form); the softplus
  gate must be activated by the caller (`use_gate_in_kernel=False`), and then
  its numerical range is the caller's responsibility: the kernel factors
  exp(G_i - G_j) around the middle of 16-token sub-chunks, so per-token log
  decays far below -5 can overflow inside it;
* under `context_axis` (tokamax's context-parallel kernel): K and V
  multiples of 128, no initial or final state.

Packed segments: the kernel reads a row as segments 1, 2, .. in order, one
run each, padding only at the end. Every other layout the op accepts is
brought to that form per row (`_canonical_layout`): padding (a no-op) moves
to the end by a stable permutation, each run (a maximal stretch of one id
once padding is gone) gets the next id and its segment's initial state, a
segment's final state is its last run's, and the outputs go back to the
input order. Without states any layout runs; with states the kernel holds
one per run in max_num_segments slots, so a segment id that comes back
after another segment (more runs than slots) raises NotImplementedError
(NaN rows when segment_ids are traced and cannot be checked). Under
`context_axis` (tokamax's context-parallel kernel, no states) every token
is labelled with the global index of its run (`_global_runs`: one
all-gather of two ints a row per rank), padding joining the run before it
as a no-op token, so any layout runs there too; a rank holding more runs
than max_num_segments (default T_local) gets NaN rows.

With packed segments, tokamax 0.0.17's backward returns NaN gradients at
padding positions (segment id 0), for the initial states of segments that
have no token in a row (measured: H=1, T=100, K=V=32, two segments, trailing
padding), and for a_log and dt_bias of its fused gate. Its forward is right
there, so this adapter keeps the op's contract around it: padding tokens are
no-ops, so their gradients are zero; a segment absent from a row has its
initial state as final state, so that gradient is passed straight through;
with segments the gate is activated here, before the kernel. The first two
are selects, which drop the NaN cotangents.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.kda import common
from linear_attention.ops.kda import gates
from linear_attention.ops.kda import mosaic

NAME = "tokamax"
CHECK_VMA = False  # tokamax's pallas_calls do not trace under check_vma
NEEDS_TPU = True  # off TPU: only in Pallas interpret mode
MIN_TPU_GENERATION = 6  # tokamax 0.0.17's `supported_on`
# Why the v5e stays refused, measured (benchmarks/results/
# kda_tpu_mosaic_v5e.json: the kernel run there with tokamax's check lifted,
# float32 inputs, B2 T1024 H4 K128, against a float64 recurrence).
V5E_MEASURED = (" Run on a TPU v5e with that check lifted, it keeps about"
                " three digits with float32 inputs (output 1.6e-3, gradients"
                " up to 1.2e-3 relative L2; the op's float32 bound is 1e-5),"
                " so this backend keeps to v6+; on a v5e use 'chunked' or"
                " 'pallas'.")
MAX_KEY_DIM = 256
CHUNK = 64  # the kernel's chunk
CP_MULTIPLE = 128  # K and V of its context-parallel kernel


def supports_target(target: backends.Target) -> str | None:
  """Why the kernel cannot run on `target`, or None."""
  if target.off_tpu_mode == "interpret":
    return None  # Pallas interpret mode runs on any device
  if target.platform == "tpu":
    generation = target.tpu_generation
    if generation is None or generation < MIN_TPU_GENERATION:
      return (f"tokamax's Mosaic KDA kernel supports TPU"
              f" v{MIN_TPU_GENERATION}+ only"
              " (PallasMosaicTpuKimiDeltaAttention.supported_on); the target"
              f" {target.device_kind!r} is TPU generation {generation}."
              + (V5E_MEASURED if "v5 lite" in target.device_kind.lower()
                 else ""))
    return None
  return mosaic.off_tpu_reason(
      f"tokamax's Pallas kernel (TPU v{MIN_TPU_GENERATION}+)",
      target.device_kind)


def supports(call: common.Call) -> str | None:
  """Why the kernel cannot take `call`, or None (see the module docstring)."""
  q, v = call.q, call.v
  _, t, _, kd = q.shape
  vd = v.shape[-1]
  if call.chunk_size not in (None, CHUNK):
    return (f"tokamax's kernel runs {CHUNK}-token chunks; got"
            f" chunk_size={call.chunk_size}.")
  if call.precision != "auto":
    return ("tokamax's kernel pins its own matmul precision; precision must"
            f" be 'auto', got {call.precision!r}.")
  if call.output_chunk_states:
    return ("output_chunk_states is implemented on the 'reference',"
            " 'chunked' and 'pallas' backends (tokamax's kernel returns no"
            " intermediate states).")
  if call.context_axis is not None:
    limits = []
    if kd % CP_MULTIPLE or vd % CP_MULTIPLE:
      limits.append(f"K and V must be multiples of {CP_MULTIPLE} (got K={kd},"
                    f" V={vd})")
    if call.initial_state is not None:
      limits.append("initial_state is not supported")
    if call.output_final_state:
      limits.append("output_final_state=True is not supported")
    if limits:
      return ("with context_axis it runs tokamax's context-parallel kernel,"
              " which has these limits: " + "; ".join(limits) + ". Use"
              " backend='chunked' (exact state passing) instead.")
  reason = supports_target(call.target)
  if reason is not None:
    return reason
  if q.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != q.dtype:
    return ("tokamax's kernel takes float32 and bfloat16 q/k/v of one dtype;"
            f" got q {q.dtype}, v {v.dtype}.")
  if kd > MAX_KEY_DIM:
    return f"tokamax's kernel takes K <= {MAX_KEY_DIM}; got K={kd}."
  if call.segment_ids is None and t % CHUNK:
    return (f"tokamax's kernel needs T to be a multiple of {CHUNK} without"
            f" segment_ids; got T={t}. Pass segment_ids (padding = 0)"
            " instead.")
  if call.use_gate_in_kernel and call.lower_bound is None:
    return ("tokamax's kernel fuses only the lower-bound gate (lower_bound in"
            " [-5, 0)); activate the softplus gate first and pass"
            " use_gate_in_kernel=False.")
  return None


def decode_fallback(call: common.Call) -> str | None:
  """The backend that runs a decode piece the kernel cannot: "chunked" for
  a T that is not a multiple of its chunk; None otherwise."""
  return "chunked" if call.q.shape[1] % CHUNK else None


def run(call: common.Call):
  """The call on tokamax's kernel (its context-parallel kernel under a
  context axis); `supports(call)` is None."""
  xs = (call.q, call.k, call.v, call.g, call.beta)
  kwargs = call.op_kwargs()
  if call.context_axis is not None:
    return kda_tokamax_context_parallel(
        *xs, context_axis=call.context_axis, **kwargs)
  return kda_tokamax(*xs, **kwargs)


def _detach_padding(segment_ids, xs):
  """Padding is a no-op: route no cotangent into tokamax's there."""
  if segment_ids is None:
    return xs
  valid = (segment_ids > 0)[:, :, None]
  return tuple(jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 3)), x,
                         jax.lax.stop_gradient(x)) for x in xs)


def _call_tokamax(q, k, v, g, beta, *, a_log, dt_bias, segment_ids,
                  **kwargs):
  """tokamax's kernel on our [B, T, H, *] layout: o [B, T, H, V] and state."""
  # Imported lazily: tokamax's Pallas TPU modules are only needed here.
  from tokamax._src.ops.kda import api as tokamax_kda  # pylint: disable=g-import-not-at-top

  head_first = lambda x: jnp.moveaxis(x, 2, 0)  # [B,T,H,*] -> [H,B,T,*]
  o, state = tokamax_kda.kimi_delta_attention(
      head_first(q), head_first(k), head_first(v), head_first(g),
      jnp.moveaxis(beta, 2, 0),
      a_log=None if a_log is None else a_log.astype(jnp.float32),
      delta_time_bias=None if dt_bias is None else dt_bias.astype(jnp.float32),
      segment_ids=None if segment_ids is None else segment_ids.astype(
          jnp.int32),
      implementation="mosaic", **kwargs)
  return jnp.moveaxis(o, 0, 2).astype(q.dtype), state


class _Layout(NamedTuple):
  """A packed layout brought to the kernel's canonical form, per row."""

  order: jax.Array  # [B, T]: token order with padding last (stable)
  inverse: jax.Array  # [B, T]: undoes `order`
  runs: jax.Array  # [B, T]: run ids 1, 2, .. in order, 0 = padding
  run_segment: jax.Array  # [B, T + 1]: the segment id of each run id
  last_run: jax.Array  # [B, N + 1]: each segment's last run (0: absent)


def _canonical_layout(segment_ids, num_segments: int) -> _Layout:
  """tokamax's kernel reads a row as segments 1, 2, .. one run each, then
  padding. Any layout the op accepts maps onto that: padding is a no-op, so
  moving it to the end (a stable permutation) changes nothing, and then each
  run (a maximal stretch of one id) gets the next id, with its segment's
  initial state; a segment's final state is its last run's.
  """
  b, t = segment_ids.shape
  rows = jnp.arange(b)[:, None]
  order = jnp.argsort(segment_ids <= 0, axis=1, stable=True)
  packed = jnp.take_along_axis(segment_ids, order, axis=1)
  previous = jnp.pad(packed[:, :-1], ((0, 0), (1, 0)))
  runs = jnp.where(packed > 0, jnp.cumsum(
      (packed > 0) & (packed != previous), axis=1), 0)
  run_segment = jnp.zeros((b, t + 1), packed.dtype).at[rows, runs].set(packed)
  last_run = jnp.zeros((b, num_segments + 1), runs.dtype).at[
      rows, jnp.clip(packed, 0, num_segments)].max(runs)
  return _Layout(order=order, inverse=jnp.argsort(order, axis=1), runs=runs,
                 run_segment=run_segment.at[:, 0].set(0), last_run=last_run)


def _check_layout_fits(layout: _Layout, slots: int) -> None:
  """A row with more runs than state slots cannot go to the kernel."""
  if isinstance(layout.runs, jax.core.Tracer):
    return  # traced: such rows come out NaN (`kda_tokamax`)
  runs = int(layout.runs.max(initial=0))
  if runs > slots:
    raise NotImplementedError(
        f"backend='tokamax' with states runs each run of a segment (a stretch"
        f" of one id) in its own state slot, max_num_segments ({slots}) of"
        f" them; a row here has {runs} runs (a segment id that comes back"
        " after another segment). Give every document its own id, or use"
        " backend='chunked'.")


def kda_tokamax(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments (a
  call that `supports` takes)."""
  dtype = q.dtype
  xs = tuple(x.astype(dtype) for x in (q, k, v, g, beta))
  call = functools.partial(
      _call_tokamax, a_log=a_log, dt_bias=dt_bias, scale=scale,
      use_qk_l2norm=use_qk_l2norm, use_gate_in_kernel=use_gate_in_kernel,
      lower_bound=lower_bound, output_final_state=output_final_state)
  if initial_state is not None:
    initial_state = initial_state.astype(jnp.float32)
  if segment_ids is None:
    o, final_state = call(
        *xs, segment_ids=None, max_num_segments=None,
        initial_state=common.with_segment_axis(initial_state))
    final_state = common.without_segment_axis(final_state)
    return o, (final_state.astype(jnp.float32) if output_final_state
               else None)
  if use_gate_in_kernel:
    # tokamax 0.0.17's fused gate returns NaN da_log and ddt_bias with
    # padding in a row; activated here, the padding's share is detached.
    xs = xs[:3] + (gates.kda_log_decay(
        g, a_log, dt_bias, lower_bound, dtype=jnp.float32).astype(dtype),
                   xs[4])
    call = functools.partial(call, a_log=None, dt_bias=None,
                             use_gate_in_kernel=False, lower_bound=None)
  with_states = initial_state is not None or output_final_state
  # Without states a row's runs need no slots: T bounds their number.
  slots = max_num_segments if with_states else q.shape[1]
  layout = _canonical_layout(segment_ids, max_num_segments or 1)
  if with_states:
    _check_layout_fits(layout, slots)
  packed = lambda x: jnp.take_along_axis(
      x, layout.order.reshape(layout.order.shape + (1,) * (x.ndim - 2)),
      axis=1)
  xs = _detach_padding(layout.runs, tuple(map(packed, xs)))
  run_init = None
  if initial_state is not None:
    seg = layout.run_segment[:, 1:slots + 1]  # [B, slots]
    # A slot without a run starts from zeros: tokamax's NaN cotangents for
    # states of absent segments stop at this select.
    run_init = jnp.where(
        (seg > 0)[..., None, None, None],
        jnp.take_along_axis(initial_state, jnp.maximum(seg - 1, 0)[
            ..., None, None, None], axis=1), 0.0)
  o, run_final = call(*xs, segment_ids=layout.runs, max_num_segments=slots,
                      initial_state=run_init)
  o = jnp.take_along_axis(
      o, layout.inverse[..., None, None], axis=1)  # back to the input order
  too_many = jnp.max(layout.runs, axis=1) > slots  # only when traced
  o = jnp.where(too_many[:, None, None, None], jnp.nan, o)
  if not output_final_state:
    return o, None
  last = layout.last_run[:, 1:]  # [B, N]
  final_state = jnp.take_along_axis(
      run_final.astype(jnp.float32),
      jnp.maximum(last - 1, 0)[..., None, None, None], axis=1)
  start = (jnp.zeros_like(final_state) if initial_state is None
           else initial_state)
  final_state = jnp.where((last > 0)[..., None, None, None], final_state,
                          start)
  return o, jnp.where(too_many[:, None, None, None, None], jnp.nan,
                      final_state)


def kda_tokamax_context_parallel(
    q, k, v, g, beta, *, context_axis, scale, a_log, dt_bias, lower_bound,
    use_gate_in_kernel, use_qk_l2norm, initial_state, output_final_state,
    segment_ids, max_num_segments):
  """tokamax's Mosaic kernel with its own context parallelism (a call that
  `supports` takes: no states)."""
  del initial_state, output_final_state  # None and False (`supports`)
  from tokamax._src.ops.kda import cp_utils  # pylint: disable=g-import-not-at-top

  metadata = cp_utils.ContextParallelMetadata(
      jax.sharding.get_abstract_mesh(), context_axis)
  dtype = q.dtype
  xs = tuple(x.astype(dtype) for x in (q, k, v, g, beta))
  call = functools.partial(
      _call_tokamax, scale=scale, use_qk_l2norm=use_qk_l2norm,
      context_parallel_metadata=metadata)
  if segment_ids is None:
    # tokamax's CP kernel takes only packed rows: one document per row (the
    # rank-local slice of a global row of ones) is the unpacked sequence.
    o, _ = call(*xs, a_log=a_log, dt_bias=dt_bias,
                segment_ids=jnp.ones(q.shape[:2], jnp.int32),
                use_gate_in_kernel=use_gate_in_kernel,
                lower_bound=lower_bound, max_num_segments=1)
    return o, None
  if use_gate_in_kernel:  # padding's decay must be exactly 0 (below)
    xs = xs[:3] + (gates.kda_log_decay(
        g, a_log, dt_bias, lower_bound, dtype=jnp.float32).astype(dtype),
                   xs[4])
  labels = _global_runs(segment_ids, context_axis)
  valid = segment_ids > 0
  # Padding joins the run before it as a no-op token: no write (k, v, beta
  # 0), no decay (g 0), its output dropped; so no cotangent reaches it.
  xs = tuple(jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x,
                       jnp.zeros_like(x)) for x in xs)
  slots = q.shape[1] if max_num_segments is None else max_num_segments
  o, _ = call(*xs, a_log=None, dt_bias=None, segment_ids=labels,
              use_gate_in_kernel=False, lower_bound=None,
              max_num_segments=slots)
  o = jnp.where(valid[..., None, None], o, 0.0)
  # More runs on this rank than the kernel's slots: not computable here.
  too_many = labels[:, -1] - labels[:, 0] + 1 > slots
  return jnp.where(too_many[:, None, None, None], jnp.nan, o), None


def _global_runs(segment_ids, context_axis):
  """[B, T_local] ids -> labels 1, 2, .. of the global runs, on every token.

  tokamax's context-parallel kernel starts a segment wherever the id
  changes, padding included, and continues one across ranks when a rank's
  first id equals the previous rank's last. The op's runs (`common`: a run
  continues through padding) map onto that by labelling each run with its
  global index, counted over the ranks before this one, and padding with
  the label of the run before it (the first run's before any).
  """
  b, t = segment_ids.shape
  valid = segment_ids > 0
  pos = jnp.arange(t, dtype=jnp.int32)[None, :]
  last_valid = jax.lax.cummax(jnp.where(valid, pos, -1), axis=1)
  filled = jnp.where(last_valid >= 0, jnp.take_along_axis(
      segment_ids, jnp.maximum(last_valid, 0), axis=1), 0)  # forward fill
  # The id of the last valid token before this rank (0: none).
  ids_all = jax.lax.all_gather(filled[:, -1], context_axis)  # [R, B]
  rank = jax.lax.axis_index(context_axis)
  incoming = jnp.zeros((b,), segment_ids.dtype)
  for j in range(ids_all.shape[0] - 1):
    incoming = jnp.where((rank > j) & (ids_all[j] > 0), ids_all[j], incoming)
  before_here = jnp.pad(filled[:, :-1], ((0, 0), (1, 0)))
  previous = jnp.where(before_here > 0, before_here, incoming[:, None])
  starts = valid & (segment_ids != previous)
  counts = jax.lax.all_gather(jnp.sum(starts, axis=1, dtype=jnp.int32),
                              context_axis)  # [R, B]
  before = jnp.sum(jnp.where((jnp.arange(counts.shape[0]) < rank)[:, None],
                             counts, 0), axis=0)  # [B]
  return jnp.maximum(
      before[:, None] + jnp.cumsum(starts, axis=1, dtype=jnp.int32), 1)
