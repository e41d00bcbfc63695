"""Backend "pallas": our Pallas TPU kernels (`pallas_batched.py`) behind the op.

The forward kernel takes the op's raw inputs in its own [B, T, H, *] layout
and does the preparation itself (q/k L2 norm, the scale, the lower-bound
gate); the backward kernel runs under a custom VJP. Design and measurements:
docs/kernel.md. `supports` names the kernel's limits (the op raises them as
`NotImplementedError` for an explicit `backend="pallas"`, and "auto" passes
over it):

* a TPU (developed on v5e, exported for v5e and v6e), the target of
  `mosaic.lowering_mode()`, or any device inside `mosaic.interpreted()`
  (Pallas interpret mode: tests);
* float32 or bfloat16 q, k, v of one dtype; K and V multiples of 128;
* the fused lower-bound gate (`use_gate_in_kernel=True` with
  `lower_bound` in [-5, 0)): the kernel's exponent factors need every log
  decay >= -5, which neither the softplus gate nor a pre-activated g
  guarantees (and a traced g cannot be checked);
* chunk 16, 32, 64 (the default) or 128 tokens;
* packed segments with padding anywhere, and their per-segment states
  (`initial_state` [B, N, H, K, V], `output_final_state`): each run then
  starts on a chunk edge (`pallas_batched._realign`), so a row holds at most
  N runs; a call with a row of more (a segment met again after another
  can make one) runs on `chunked` as a whole, chosen on the device
  (`jax.lax.cond`);
* chunk-boundary states (`output_chunk_states`) in the kernels' one pass
  (`one_pass_chunk_states`: C a multiple of the chunk, no per-segment
  states, no context axis): the forward kernel writes its carried state at
  every C-th token, the backward adds their cotangents there
  (`pallas_batched.kda(..., chunk_states_every=C)`); padding's boundaries
  are zeroed here;
* `context_axis`, and the other chunk-boundary states, by the exact state
  passing of `context_parallel`, whose local calls are packed segments with
  per-segment states (a shard's or a piece's first run in a slot of its
  own): the calls with few runs a row run on the kernels; a row of many
  runs (packed documents without states) on `chunked`.

"auto" picks this backend only inside the class of calls measured faster
than every other backend on a chip (`auto_declines`, `AUTO_CLASS`;
docs/kernel.md and the `kda_tpu_session*_v5e.json` files in
benchmarks/results): a TPU v5e, precision "auto", K = V = 128, 64-token
chunks, the q/k L2 norm, no context axis, and
  * bfloat16 with H a multiple of 16 and T >= 128, with chunk-boundary
    states at least 1024 tokens apart or none,
  * float32 with H a multiple of 8 and T >= 256, without chunk-boundary
    states,
  each with packed segments, with or without per-segment states
  (max_num_segments x 63 <= T / 8: the realigned layout's extra grid at
  most an eighth), or none.
There, in device time forward and forward+backward, bfloat16: B1 T8192 H32
1.7 and 5.5 ms strided (the chunked backend 5.8 and 26.9; tokamax's kernel
4.0 and 12.1), B8 T4096 H16 3.5 and 11.7 ms strided (tokamax 8.6 and
27.2), B1 T1024 H32 0.28 and 0.83 ms (chunked 0.73 and 2.79, tokamax 0.43
and 1.39), B1 T512 H32 0.14 and 0.42 ms (chunked 0.37 and 1.37, tokamax
0.22 and 0.72), B1 T256 H32 0.08 and 0.21 ms (chunked 0.18 and 0.70,
tokamax 0.11 and 0.35), B1 T128 H32 0.04 and 0.10 ms (chunked 0.09 and
0.35, tokamax 0.05 and 0.18), B1 T8192 H32 packed with 1024-token
documents 2.7 and 7.2 ms (chunked 10.7 and 39.1), and with their
per-segment states 5.7 and 14.8 ms (chunked 52.1 and 118.9), B1 T8192 H32
with the state after every 1024 tokens 1.95 and 5.57 ms in the kernels'
one pass (through the pieces of `context_parallel` before it, 12.7 and 43.2;
chunked 58.2 and 149.9), and after every 64 tokens 3.59 and 6.45 ms
(chunked 87.9 and 216.7; closer states are not in the class until timed at
shorter T); float32 at B1 H32: T8192 6.2 and 15.8 ms (chunked 12.0 and 47.7),
T1024 0.66 and 1.86 ms (chunked 1.46 and 5.31), T512 0.33 and 0.91 ms
(chunked 0.71 and 2.51), T256 0.17 and 0.45 ms (chunked 0.36 and 1.24),
T8192 packed with 1024-token documents 6.4 and 16.1 ms (chunked 16.9 and
62.8), with their per-segment states 11.7 and 30.6 ms (chunked 60.8 and
138.3). Elsewhere (T below those, H not a multiple, a context axis,
closer chunk-boundary states, other chips) it has not been timed against
the others, so "auto" passes over it;
`backend="pallas"` runs it wherever `supports` allows.

bfloat16 calls with K = V = 128, H 16 or 32 and no packed segments read
and write the op's layout as rows, all heads a grid step, with no relayout
around the kernels (`STRIDED`, `STRIDED_PRIMAL`; on any TPU, an explicit
`backend="pallas"` included). From T 4096 both kernels run strided: at B1
T8192 H32 the forward takes 1.70 ms of device time against 2.39 for 16
heads a step, forward+backward 5.53 against 6.04 (16041ff's kernels; 1.90
against 2.58 and 6.42 against 6.90 at e3a765f); at B8 T4096 H16 3.53
against 5.37 and 11.66 against 13.99. From T 1024 a call that is not
differentiated runs the strided forward (B1 H32: T2048 0.48 ms against
0.57, T1024 0.25 against 0.28) and a differentiated one the 16-heads pair
(the strided backward was not timed below T 4096).

float32 inputs at precision "auto" run every group at HIGH (three bfloat16
passes, `FLOAT32_AUTO`), not HIGHEST (six): within the op's float32 bounds
against the float64 recurrence (output 6.8e-6, gradients 2.6e-4 at most,
measured in interpret mode, where `pallas_batched._dot` writes HIGH out as
the chip computes it), at 1.56x the one-pass forward time on a v5e where
HIGHEST takes 2.14x (1.70x and 2.45x forward+backward).

Grouped value heads arrive with q and k already repeated (`common.Call`).
`group_width` (the chunked backend's schedule) does not apply and is not
read. A decode piece shorter than a chunk runs the token recurrence (the
op's decode rule).
"""

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.kda import chunked
from linear_attention.ops.kda import common
from linear_attention.ops.kda import context_parallel
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import pallas_batched
from linear_attention.ops.kda import precision as precision_lib

Precision = precision_lib.Precision

NAME = "pallas"
CHECK_VMA = False  # a pallas_call does not trace under check_vma
NEEDS_TPU = True  # off TPU: only in Pallas interpret mode
CHUNKS = (16, 32, 64, 128)
DEFAULT_CHUNK = 64
LANES = pallas_batched.LANES


# The measured class (see the module docstring): per dtype, the heads a grid
# step runs (H must be a multiple) and the shortest T timed faster; packed
# segments, with and without per-segment states, were timed for both.
AUTO_DEVICE_KIND = "v5 lite"  # as in "TPU v5 lite"
# H enters only as grid rows of that step shape, so any multiple is taken
# (bfloat16 timed at H16 and H32, float32 at H32).
AUTO_CLASS = {
    # T 128, 256, 512, 1024, 2048, 4096 and 8192; 1024-token documents at
    # T 8192; the state after every 1024 tokens at T 8192 (through the
    # pieces, then in the kernels' one pass).
    "bfloat16": dict(heads=16, min_t=128, chunk_states_every=1024),
    # T 256, 512, 1024 and 8192, 1024-token documents at T 8192, at HIGH
    # (FLOAT32_AUTO); chunk-boundary states not timed.
    "float32": dict(heads=8, min_t=256, chunk_states_every=None),
}
# Per-segment states lay every run out from a chunk edge, which adds up to
# N (C - 1) tokens to the grid: timed at N = 8 and T 8192 (504 tokens, a
# sixteenth), so the class takes N (C - 1) <= T / 8.
AUTO_MAX_STATES_GROWTH = 8
AUTO_HEADS_PER_BLOCK = AUTO_CLASS["bfloat16"]["heads"]  # 16 beat 8 (bf16)
# Where both kernels run strided, and where a call that is not
# differentiated runs the strided forward (the module docstring;
# `kda_tpu_session_strided_rows_v5e.json`): timed at H 16 and 32 (all heads
# a step is VMEM), bfloat16, K = V = 128, no packed segments (strided reads
# have none).
STRIDED = dict(dtype="bfloat16", heads=(16, 32), min_t=4096)
STRIDED_PRIMAL = dict(dtype="bfloat16", heads=(16, 32), min_t=1024)
# float32 at precision "auto" (the module docstring).
FLOAT32_AUTO = precision_lib.Precisions.every(Precision.HIGH)


def supports_target(target: backends.Target) -> str | None:
  """Why the kernels cannot run on `target`, or None."""
  if target.off_tpu_mode == "interpret" or target.platform == "tpu":
    return None
  return mosaic.off_tpu_reason("our Pallas TPU kernel", target.device_kind)


def supports(call: common.Call) -> str | None:
  """Why the kernels cannot take `call`, or None (see the module docstring)."""
  q, v = call.q, call.v
  kd, vd = q.shape[-1], v.shape[-1]
  if call.chunk_size not in (None,) + CHUNKS:
    return (f"our Pallas kernel runs chunks of {', '.join(map(str, CHUNKS))}"
            f" tokens; got chunk_size={call.chunk_size}.")
  reason = supports_target(call.target)
  if reason is not None:
    return reason
  if (q.dtype.name not in ("float32", "bfloat16") or v.dtype != q.dtype
      or call.k.dtype != q.dtype):
    return ("our Pallas kernel takes float32 or bfloat16 q, k, v of one"
            f" dtype; got q {q.dtype}, k {call.k.dtype}, v {v.dtype}.")
  if kd % LANES or vd % LANES:
    return (f"our Pallas kernel needs K and V to be multiples of {LANES} (TPU"
            f" lanes); got K={kd}, V={vd}.")
  if not call.use_gate_in_kernel or call.lower_bound is None:
    return ("our Pallas kernel needs the fused lower-bound gate"
            " (use_gate_in_kernel=True, lower_bound in [-5, 0)): its"
            " exponent factors need every log decay >= -5, which the softplus"
            " gate and a pre-activated g do not guarantee.")
  return None


def auto_declines(target: backends.Target,
                  call: common.Call | None = None) -> str | None:
  """Why "auto" passes over the kernels for `call` (None: for any call on
  `target`): outside the class measured faster than the other backends."""
  if (target.platform != "tpu"
      or AUTO_DEVICE_KIND not in target.device_kind.lower()):
    return ("measured faster than the other backends only on a TPU v5e so"
            f" far; the target is {target.device_kind!r}")
  if call is None:
    return f"chosen per call on a TPU v5e ({_class_text()})"
  _, t, h, kd = call.q.shape
  vd = call.v.shape[-1]
  cls = AUTO_CLASS.get(call.q.dtype.name)
  if (cls is None or kd != LANES or vd != LANES or h % cls["heads"]
      or t < cls["min_t"] or call.precision != "auto"
      or call.chunk_size not in (None, DEFAULT_CHUNK)
      or not call.use_qk_l2norm
      or (_segment_states(call) and call.max_num_segments
          * (DEFAULT_CHUNK - 1) * AUTO_MAX_STATES_GROWTH > t)
      or call.context_axis is not None
      or not _chunk_states_timed(call, cls)):
    return (f"measured faster only for {_class_text()}; got"
            f" {call.q.dtype.name}, precision {call.precision!r}, K={kd},"
            f" V={vd}, H={h}, T={t}, chunk_size={call.chunk_size},"
            f" use_qk_l2norm={call.use_qk_l2norm}, packed segments:"
            f" {call.segment_ids is not None}, per-segment states:"
            f" {_segment_states(call)} (max_num_segments="
            f"{call.max_num_segments}), context_axis={call.context_axis},"
            f" output_chunk_states={call.output_chunk_states}"
            f" (chunk_states_every={call.chunk_states_every})")
  return None


def _chunk_states_timed(call: common.Call, cls) -> bool:
  """No chunk-boundary states, or states as far apart as timed."""
  every = cls["chunk_states_every"]
  return not call.output_chunk_states or (
      every is not None and call.chunk_states_every >= every)


def _class_text() -> str:
  """The measured class in words (`AUTO_CLASS`)."""
  def states(c):
    return (f"chunk-boundary states at least {c['chunk_states_every']}"
            " tokens apart or none" if c["chunk_states_every"]
            else "no chunk-boundary states")
  per_dtype = "; ".join(
      f"{name} with H a multiple of {c['heads']}, T >= {c['min_t']} and"
      f" {states(c)}" for name, c in AUTO_CLASS.items())
  return (f"precision 'auto', K = V = {LANES}, {DEFAULT_CHUNK}-token chunks,"
          f" the q/k L2 norm, no context axis,"
          f" packed segments (with per-segment states: max_num_segments"
          f" x {DEFAULT_CHUNK - 1} <= T / {AUTO_MAX_STATES_GROWTH}) or none:"
          f" {per_dtype}")


def heads_per_block(call: common.Call) -> int | None:
  """Heads a grid step: 16 for bfloat16 with K = V = 128 where H allows
  (measured faster than 8 forward and backward at both shapes above, on a
  v5e; used on any TPU, an explicit `backend="pallas"` included), else the
  kernel's default (the largest divisor of H up to 8)."""
  h, kd = call.q.shape[2:]
  if (call.q.dtype.name == "bfloat16" and h % AUTO_HEADS_PER_BLOCK == 0
      and kd == LANES and call.v.shape[-1] == LANES):
    return AUTO_HEADS_PER_BLOCK
  return None


def strided(call: common.Call) -> bool:
  """Whether the call runs the strided forward and backward (`STRIDED`)."""
  return _in_strided_class(call, STRIDED)


def strided_primal(call: common.Call) -> bool:
  """Whether a call that is not differentiated runs the strided forward and
  a differentiated one the 16-heads-a-step pair (`STRIDED_PRIMAL`, below
  `STRIDED`)."""
  return _in_strided_class(call, STRIDED_PRIMAL) and not strided(call)


def _in_strided_class(call: common.Call, cls) -> bool:
  _, t, h, kd = call.q.shape
  return (call.q.dtype.name == cls["dtype"] and h in cls["heads"]
          and t >= cls["min_t"] and kd == LANES
          and call.v.shape[-1] == LANES and call.segment_ids is None
          and (call.chunk_size or DEFAULT_CHUNK) == DEFAULT_CHUNK)


def precisions(call: common.Call) -> precision_lib.Precisions:
  """The kernels' precision per group: the op's rule, but `FLOAT32_AUTO`
  for float32 inputs at "auto" (see the module docstring)."""
  if call.precision == "auto" and call.q.dtype.name == "float32":
    return FLOAT32_AUTO
  return precision_lib.resolve(call.precision, call.q.dtype)


def _segment_states(call: common.Call) -> bool:
  """Whether `call` has packed segments with per-segment states."""
  return call.segment_ids is not None and (
      call.initial_state is not None or call.output_final_state)


def run(call: common.Call):
  """The call on our kernels; `supports(call)` is None. Chunk-boundary
  states in one pass where `one_pass_chunk_states` allows; else, and under
  a context axis, through `context_parallel.run`, whose per-rank
  (per-piece) calls are packed segments with per-segment states."""
  if call.output_chunk_states and one_pass_chunk_states(call):
    return _run_one(call)

  def local(q, k, v, g, beta, *, initial_state, output_final_state,
            segment_ids, max_num_segments, **_):
    return _run_one(call._replace(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids,
        max_num_segments=max_num_segments, context_axis=None,
        output_chunk_states=False))
  return context_parallel.run(local, call)


def one_pass_chunk_states(call: common.Call) -> bool:
  """Whether the kernels write `call`'s chunk-boundary states in their one
  pass (`pallas_batched.kda(..., chunk_states_every=...)`): no context
  axis, the distance a multiple of the chunk, and no per-segment states
  (their layout moves runs off the boundaries)."""
  return (call.context_axis is None and not _segment_states(call)
          and call.chunk_states_every % (call.chunk_size or DEFAULT_CHUNK)
          == 0)


def _run_one(call: common.Call):
  """One call on one device (no context axis; chunk-boundary states only
  where `one_pass_chunk_states`)."""
  states = _segment_states(call)
  n = call.max_num_segments if states else None
  rows = strided(call)  # all heads a step: no heads_per_block to pass
  every = call.chunk_states_every if call.output_chunk_states else None

  def kernels():
    return pallas_batched.kda(
        call.q, call.k, call.v, call.g, call.beta, call.initial_state,
        scale=call.scale, a_log=call.a_log, dt_bias=call.dt_bias,
        lower_bound=call.lower_bound, use_gate_in_kernel=True,
        use_qk_l2norm=call.use_qk_l2norm,
        precision=precisions(call),
        chunk=call.chunk_size or DEFAULT_CHUNK,
        heads_per_block=None if rows else heads_per_block(call),
        strided=rows, strided_primal=strided_primal(call),
        segment_ids=call.segment_ids, num_segments=n,
        chunk_states_every=every,
        interpret=call.target.off_tpu_mode == "interpret")

  if every is not None:
    o, final, bounds = kernels()
    if call.segment_ids is not None:  # zeros where the boundary is padding
      ends = call.segment_ids[:, every - 1::every][:, :bounds.shape[1]]
      bounds = jnp.where((ends != 0)[:, :, None, None, None], bounds, 0.0)
    return o, final if call.output_final_state else None, bounds
  if not states:
    o, final = kernels()
    return o, final if call.output_final_state else None

  def on_chunked():  # a row with more than N runs (`_realign`'s bound)
    o, final = chunked.run(call._replace(output_final_state=True))
    return o.astype(call.q.dtype), final.astype(jnp.float32)

  over = jnp.any(pallas_batched.too_many_runs(call.segment_ids, n))
  o, final = jax.lax.cond(over, on_chunked, kernels)
  return o, final if call.output_final_state else None
