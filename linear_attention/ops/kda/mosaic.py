"""Adapter to tokamax's Pallas/Mosaic TPU KDA kernel: the one file that
touches tokamax internals (`tokamax._src`, checked against tokamax 0.0.17).

tokamax 0.0.17 (`tokamax.ops.kimi_delta_attention(implementation="mosaic")`)
is head-first: q, k, g [H, B, T, K], v [H, B, T, V], beta [H, B, T], states
[B, N, H, K, V]. This file transposes our [B, T, H, *] layout in and out and
turns the kernel's limits into `NotImplementedError`s that name them:

* TPU v6 or newer; on any device inside `interpreted()` (the kernel in
  Pallas interpret mode, which `experiments.interpret.interpret_mode` sets
  up) or `lowering_mode()` (exports it for a TPU, by JAX's abstract-mesh
  cross-lowering);
* float32 or bfloat16 inputs; K <= 256; chunk size 64;
* without `segment_ids`, T must be a multiple of 64;
* the fused gate needs `lower_bound` (tokamax's safe-gate form); the softplus
  gate must be activated by the caller (`use_gate_in_kernel=False`), and then
  its numerical range is the caller's responsibility: the kernel factors
  exp(G_i - G_j) around the middle of 16-token sub-chunks, so per-token log
  decays far below -5 can overflow inside it.

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

import contextlib
import functools
import threading
from typing import NamedTuple

import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.kda import common
from linear_attention.ops.kda import gates

MAX_KEY_DIM = 256
CHUNK = backends.MOSAIC_CHUNK  # the kernel's chunk, owned by the policy

_state = threading.local()


def chip_version(chip) -> pltpu.ChipVersion:
  """A `pltpu.ChipVersion` from itself or a name ("v6e", "v5p", "7x", ...)."""
  if isinstance(chip, pltpu.ChipVersion):
    return chip
  name = str(chip).upper().removeprefix("TPU_").removeprefix("V")
  for member in pltpu.ChipVersion:
    if member.name.removeprefix("TPU_").removeprefix("V") == name:
      return member
  raise ValueError(
      f"chip must be a TPU generation, one of"
      f" {[m.name.removeprefix('TPU_').lower() for m in pltpu.ChipVersion]};"
      f" got {chip!r}.")


def off_tpu_mode() -> str | None:
  """This thread's off-TPU mode: "interpret", "lowering", or None."""
  return getattr(_state, "mode", None)


@contextlib.contextmanager
def interpreted():
  """Lets `backend="mosaic"` run off TPU, in Pallas interpret mode.

  Interpret mode itself is two process-wide switches this library does not
  flip (it never sets the environment or replaces another package's
  functions): tokamax 0.0.17 reads `PALLAS_INTERPRET` from the environment,
  and sizes its kernel from `pltpu.get_tpu_info()` at trace time, which off
  TPU has no chip to describe. `experiments.interpret.interpret_mode(chip)`
  sets both for its duration and enters this context; so do the tests. Here
  only the op's own check is lifted (otherwise `NotImplementedError` off
  TPU), with tokamax's device check (`tokamax.config.cross_compile`).

  Yields:
    None.
  """
  import tokamax  # pylint: disable=g-import-not-at-top

  old_mode = off_tpu_mode()
  _state.mode = "interpret"
  try:
    with tokamax.config.cross_compile(True):
      yield
  finally:
    _state.mode = old_mode


# The device kind JAX reports for each chip (jax._src.tpu_info's table).
_DEVICE_KINDS = {
    "TPU_V2": "TPU v2", "TPU_V3": "TPU v3", "TPU_V4": "TPU v4",
    "TPU_V4I": "TPU v4 lite", "TPU_V5E": "TPU v5 lite", "TPU_V5P": "TPU v5",
    "TPU_V6E": "TPU v6 lite", "TPU_7": "TPU7", "TPU_7X": "TPU7x",
    "TPU_8I": "TPU8i", "TPU_8T": "TPU8t",
}
# Chips whose JAX device is a Megacore pair of TensorCores by default.
_MEGACORE = ("TPU_V4", "TPU_V5P")


def device_kind(chip) -> str:
  """The `device_kind` string JAX reports on `chip` (e.g. "TPU v6 lite")."""
  name = chip_version(chip).name
  return _DEVICE_KINDS.get(name, name.replace("_", " "))


def abstract_tpu(chip, num_cores: int | None = None):
  """A `jax.sharding.AbstractDevice` standing for one device of `chip`.

  Args:
    chip: a `pltpu.ChipVersion` or a name such as "v6e", "v5p", "7x".
    num_cores: TensorCores per JAX device; default 2 on Megacore chips (v4,
      v5p), else 1.
  """
  name = chip_version(chip).name
  if num_cores is None:
    num_cores = 2 if name in _MEGACORE else 1
  if num_cores not in (1, 2):
    raise ValueError(f"num_cores must be 1 or 2; got {num_cores!r}.")
  return jax.sharding.AbstractDevice(
      device_kind=device_kind(chip), num_cores=num_cores, platform="tpu")


def target_tpu():
  """The `AbstractDevice` of the TPU being lowered for, or None.

  Set by `lowering_mode` (or by any `jax.sharding.use_abstract_mesh` whose
  mesh names a TPU device): what Pallas' Mosaic lowering sizes for.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device if device is not None and device.platform == "tpu" else None


@contextlib.contextmanager
def lowering_mode(chip="v6e", mesh=None, *, num_cores=None):
  """Lowers `backend="mosaic"` for a TPU `chip` from any host.

  Inside it, `jax.export.export(f, platforms=["tpu"])` of a function that
  calls the op with `backend="mosaic"` traces tokamax's kernel sized for
  `chip` and lowers it to Mosaic (`tpu_custom_call`s in the module), with no
  TPU attached: check that a model lowers before paying for one. Nothing is
  patched: the context is JAX's own cross-lowering mechanism, an abstract
  mesh whose device is the target TPU (`jax.sharding.use_abstract_mesh`,
  which Pallas reads the TPU's limits from), plus tokamax's
  `tokamax.config.cross_compile` (which skips its check that the default
  device is a TPU).

  Only lowering works inside: running anything eagerly or calling a jitted
  function on concrete arrays fails (JAX needs the platforms that
  `jax.export` passes). Build inputs (`jax.eval_shape`, `ShapeDtypeStruct`s)
  outside the context, and export inside it.

  Args:
    chip: a `pltpu.ChipVersion` or a name such as "v6e", "v5p", "7x".
    mesh: the `jax.sharding.Mesh` the exported function's shardings and
      `shard_map`s use, if any (its axes become the abstract mesh's, on the
      TPU device); None for a single-device function.
    num_cores: TensorCores per device (see `abstract_tpu`).

  Yields:
    The abstract mesh in effect.
  """
  import tokamax  # pylint: disable=g-import-not-at-top

  device = abstract_tpu(chip, num_cores)
  if mesh is None:
    abstract = jax.sharding.AbstractMesh((1,), ("_tpu",),
                                         abstract_device=device)
  else:
    abstract = mesh.abstract_mesh.update(abstract_device=device)
  old_mode = off_tpu_mode()
  _state.mode = "lowering"
  try:
    with jax.sharding.use_abstract_mesh(abstract), \
         tokamax.config.cross_compile(True):
      yield abstract
  finally:
    _state.mode = old_mode


def _check_supported(q, v, *, use_gate_in_kernel, lower_bound, segment_ids):
  b, t, h, kd = q.shape
  if (jax.default_backend() != "tpu" and off_tpu_mode() is None
      and target_tpu() is None):
    raise NotImplementedError(
        "backend='mosaic' runs tokamax's Pallas kernel, which needs a TPU v6+;"
        f" the default device is {jax.default_backend()}. On CPU, call it"
        " inside `experiments.interpret.interpret_mode()` (Pallas interpret"
        " mode), export it for a TPU inside"
        " `linear_attention.ops.kda.mosaic.lowering_mode()`, or use"
        " backend='chunked'.")
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
    return  # traced: such rows come out NaN (`kda_mosaic`)
  runs = int(layout.runs.max(initial=0))
  if runs > slots:
    raise NotImplementedError(
        f"backend='mosaic' with states runs each run of a segment (a stretch"
        f" of one id) in its own state slot, max_num_segments ({slots}) of"
        f" them; a row here has {runs} runs (a segment id that comes back"
        " after another segment). Give every document its own id, or use"
        " backend='chunked'.")


def kda_mosaic(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments."""
  _check_supported(q, v, use_gate_in_kernel=use_gate_in_kernel,
                   lower_bound=lower_bound, segment_ids=segment_ids)
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


def kda_mosaic_context_parallel(
    q, k, v, g, beta, *, context_axis, scale, a_log, dt_bias, lower_bound,
    use_gate_in_kernel, use_qk_l2norm, initial_state, output_final_state,
    segment_ids, max_num_segments):
  """tokamax's Mosaic kernel with its own context parallelism."""
  from tokamax._src.ops.kda import cp_utils  # pylint: disable=g-import-not-at-top

  kd, vd = q.shape[-1], v.shape[-1]
  limits = []
  if kd % 128 or vd % 128:
    limits.append(f"K and V must be multiples of 128 (got K={kd}, V={vd})")
  if initial_state is not None:
    limits.append("initial_state is not supported")
  if output_final_state:
    limits.append("output_final_state=True is not supported")
  if limits:
    raise NotImplementedError(
        "backend='mosaic' with context_axis runs tokamax's context-parallel"
        " kernel, which has these limits: " + "; ".join(limits) + ". Use"
        " backend='chunked' (exact state passing) instead.")
  _check_supported(
      q, v, use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
      segment_ids=segment_ids)
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
