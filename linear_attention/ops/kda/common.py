"""What the KDA backends share: the call they are asked about, and the input
preparation of the XLA backends (`reference`, `chunked`).

`Call` is one validated call of `api.kimi_delta_attention`: a backend's
`supports(call)` reads it, its `run(call)` runs it. Every backend's
single-device runner takes the op's keyword set (`Call.op_kwargs`) and
returns `(o, final_state)`. The two XLA backends first bring the inputs to
one canonical form with `prepare`:

* q (times `scale`), k, v, g and beta in the compute dtype (`compute_dtype`:
  float32, or float64 when an input is float64), gates activated, q/k
  L2-normalised;
* `segment_ids` always present ([B, T] int32, 1-indexed, 0 = padding): a call
  without segments is one segment per row;
* `initial_state` always present as [B, N, H, K, V] in the compute dtype
  (zeros by default).

Segment semantics (all backends): a token whose segment id differs from the id
of the previous non-padding token of its row starts a new run of that segment,
which starts from `initial_state[:, id - 1]` (zero by default). A padding token
(id 0) writes a zero output and leaves the state untouched. The final state of
segment n is the state after its last token (its initial state if it has none).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.kda import gates


class Call(NamedTuple):
  """One validated call of the op (q and k already repeated to the value
  heads), on the device it is compiled for."""

  q: jax.Array  # [B, T, HV, K]
  k: jax.Array  # [B, T, HV, K]
  v: jax.Array  # [B, T, HV, V]
  g: jax.Array  # [B, T, HV, K]
  beta: jax.Array  # [B, T, HV]
  scale: float
  a_log: jax.Array | None
  dt_bias: jax.Array | None
  lower_bound: float | None
  use_gate_in_kernel: bool
  use_qk_l2norm: bool
  initial_state: jax.Array | None
  output_final_state: bool
  segment_ids: jax.Array | None
  max_num_segments: int | None
  output_chunk_states: bool
  chunk_states_every: int
  context_axis: str | None
  chunk_size: int | None  # as asked (None: the backend's own)
  group_width: int | None
  precision: Any  # as asked: a name or a `precision.Precisions`
  target: backends.Target

  @property
  def decode(self) -> bool:
    """A piece that continues a state where a chunked form would pad it:
    an initial state, no context axis (a shard is a slice of a long
    sequence), and no segments or T shorter than the accelerators' chunk."""
    return (self.initial_state is not None and self.context_axis is None
            and (self.segment_ids is None
                 or self.q.shape[1] < backends.ACCELERATOR_CHUNK))

  def op_kwargs(self) -> dict[str, Any]:
    """The keyword arguments every backend's single-device runner takes."""
    return dict(
        scale=self.scale, a_log=self.a_log, dt_bias=self.dt_bias,
        lower_bound=self.lower_bound,
        use_gate_in_kernel=self.use_gate_in_kernel,
        use_qk_l2norm=self.use_qk_l2norm, initial_state=self.initial_state,
        output_final_state=self.output_final_state,
        segment_ids=self.segment_ids, max_num_segments=self.max_num_segments)


def compute_dtype(*arrays) -> jnp.dtype:
  """The dtype the XLA backends compute and accumulate in.

  float32 is the floor (bf16 and f16 inputs compute in float32); float64
  when any floating input is float64 (needs `jax_enable_x64`). Integer
  arrays and None are ignored.
  """
  dtype = jnp.dtype(jnp.float32)
  for x in arrays:
    if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.floating):
      dtype = jnp.promote_types(dtype, jnp.result_type(x))
  return dtype


class Canonical(NamedTuple):
  q: jax.Array  # [B, T, H, K] compute dtype, scaled (normalised when asked)
  k: jax.Array  # [B, T, H, K]
  v: jax.Array  # [B, T, H, V]
  g: jax.Array  # [B, T, H, K] log decay (<= 0)
  beta: jax.Array  # [B, T, H]
  segment_ids: jax.Array  # [B, T] int32
  initial_state: jax.Array  # [B, N, H, K, V]
  has_segments: bool


def prepare(
    q, k, v, g, beta, *, scale, a_log, dt_bias, lower_bound,
    use_gate_in_kernel, use_qk_l2norm, initial_state, segment_ids,
    max_num_segments, dtype=None,
) -> Canonical:
  """Validated inputs -> the canonical form described above.

  `dtype` overrides the compute dtype (a caller that prepares slices passes
  the dtype of the whole call).
  """
  if dtype is None:
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  if use_qk_l2norm:
    q = gates.l2_normalize(q, dtype=dtype)
    k = gates.l2_normalize(k, dtype=dtype)
  q = jnp.asarray(q, dtype) * scale
  k = jnp.asarray(k, dtype)
  if use_gate_in_kernel:
    g = gates.kda_log_decay(g, a_log, dt_bias, lower_bound, dtype=dtype)
  g = jnp.asarray(g, dtype)
  has_segments = segment_ids is not None
  if has_segments:
    # Without states, every segment starts from zero: one slot serves all.
    n = max_num_segments if max_num_segments is not None else 1
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
  else:
    n = 1
    segment_ids = jnp.ones((b, t), jnp.int32)
  if initial_state is None:
    initial_state = jnp.zeros((b, n, h, kd, vd), dtype)
  else:
    initial_state = jnp.asarray(initial_state, dtype)
    if not has_segments:
      initial_state = with_segment_axis(initial_state)
  return Canonical(
      q=q, k=k, v=jnp.asarray(v, dtype), g=g,
      beta=jnp.asarray(beta, dtype), segment_ids=segment_ids,
      initial_state=initial_state, has_segments=has_segments)


def segment_runs(segment_ids):
  """Forward-filled run structure of [B, T] segment ids.

  Returns (run_seg, run_index, start): the segment a token's run belongs to
  (padding joins the run before it; leading padding is run segment 0), a
  per-row run counter, and where runs start (the segment semantics above;
  shared by the chunked backend and our Pallas kernels).
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


def with_segment_axis(state):
  """[B, H, K, V] -> [B, 1, H, K, V]: one sequence is one segment; None
  stays None (every backend's per-segment code takes states this way)."""
  return None if state is None else state[:, None]


def without_segment_axis(state):
  """[B, 1, H, K, V] -> [B, H, K, V], the inverse of `with_segment_axis`."""
  return None if state is None else state[:, 0]


def finish(o, final_state, *, dtype, has_segments, output_final_state):
  """Casts the output back and drops the segment axis when there was none."""
  o = o.astype(dtype)
  if not output_final_state:
    return o, None
  if not has_segments:
    final_state = without_segment_axis(final_state)
  return o, final_state


def _varying_axes(x) -> frozenset:
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def vary_like(tree, *refs):
  """Marks `tree`'s arrays varying over every shard_map axis `refs` vary over.

  Inside `shard_map` (with its default `check_vma=True`), a `lax.scan` carry
  that starts as a fresh constant but is updated from per-rank inputs changes
  type; starting it as varying keeps the op usable there. A no-op elsewhere.
  """
  axes = frozenset().union(*(_varying_axes(r) for r in jax.tree.leaves(refs)))

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree) if axes else tree
