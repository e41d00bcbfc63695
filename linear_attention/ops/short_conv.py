"""Causal depthwise short convolution, segment-aware, with a decode cache.

Kimi Linear (arXiv 2510.26692, §4) runs q, k and v through a depthwise causal
convolution of width W (4) followed by SiLU before the KDA core. Per channel c,
with w[W - 1] multiplying the current token:

    y[t, c] = act(bias[c] + sum_{s=0}^{W-1} w[W-1-s, c] * x[t-s, c] * m[t, s])

where m[t, s] = 1 when position t - s exists, is not padding and belongs to
the same run (packed document) as t, else 0. It is computed as W shifted
multiply-adds with float32 accumulation; the output has x's dtype.

Segments follow the KDA op's rule (`linear_attention.ops.kimi_delta_attention`):
ids are [B, T] ints, 1-indexed, 0 = padding; a token whose id differs from the
previous non-padding token starts a new run. A token sees only earlier tokens
of its own run: padding inside a run contributes zero and does not break it;
padding outputs zero.

Decode cache: the last W - 1 inputs before `x`, [B, W - 1, C] (zeros = the
start of a sequence). The cached inputs continue the run of `x`'s first
non-padding token (the cache does not record segment ids), so a sequence cut
anywhere inside a run (or inside padding) and fed in pieces gives the same
outputs as one call. A piece whose first document is a new one must come with
a zeroed cache in that row. The returned cache keeps only inputs of the last
run (everything else zeroed; an all-padding piece passes the cache through),
so it is valid for the next piece.

Context parallelism: with `context_axis`, inside `jax.shard_map` with T
split over that mesh axis, each rank gets the W - 1 inputs before its slice
(and their ids) from the preceding ranks, as many as needed
(`_short_conv1d_context_parallel` below).
"""

import jax
import jax.numpy as jnp

from linear_attention.ops import checks
from linear_attention.ops import context_axis as axes

ACTIVATIONS = ("silu", None)


def _validate(x, w, segment_ids, cache, activation, bias):
  checks.rank("x", x, 3, "[B, T, C]")
  b, t, c = x.shape
  if w.ndim != 2 or w.shape[1] != c or w.shape[0] < 1:
    raise ValueError(
        f"w must have shape [W, C] = [W >= 1, {c}] (C from x); got"
        f" {tuple(w.shape)}.")
  checks.shape("segment_ids", segment_ids, (b, t), "[B, T]")
  checks.integer_array("segment_ids", segment_ids)
  checks.shape("cache", cache, (b, w.shape[0] - 1, c), "[B, W - 1, C]")
  checks.one_of("activation", activation, ACTIVATIONS)
  checks.shape("bias", bias, (c,), "[C]")


def _first_nonzero(ids):
  """[B, T] ids -> [B]: the first non-zero id of each row, 0 if none."""
  first = jnp.argmax(ids != 0, axis=1)
  return jnp.take_along_axis(ids, first[:, None], axis=1)[:, 0]


def _last_run_tail(xe, ids, width):
  """The last W - 1 inputs, zeroed unless they belong to the last run."""
  if width == 1:
    return xe[:, :0]
  tail = xe[:, xe.shape[1] - (width - 1):]
  tail_ids = ids[:, ids.shape[1] - (width - 1):]
  last_id = jnp.zeros(ids.shape[:1], ids.dtype)
  for j in range(width - 1):  # id of the last non-padding token
    last_id = jnp.where(tail_ids[:, j] != 0, tail_ids[:, j], last_id)
  keep = []
  intact = jnp.ones(ids.shape[:1], bool)  # no other run after position j
  for j in reversed(range(width - 1)):
    keep.append(intact & (tail_ids[:, j] == last_id) & (last_id != 0))
    intact = intact & ((tail_ids[:, j] == 0) | (tail_ids[:, j] == last_id))
  keep = jnp.stack(keep[::-1], axis=1)  # [B, W - 1]
  return jnp.where(keep[..., None], tail, 0).astype(xe.dtype)


def short_conv1d(
    x: jax.Array,
    w: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    cache: jax.Array | None = None,
    activation: str | None = "silu",
    bias: jax.Array | None = None,
    context_axis: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Causal depthwise convolution over time (see the module docstring).

  Args:
    x: [B, T, C] inputs.
    w: [W, C] taps; w[-1] multiplies the current token, w[-1 - s] the token
      s steps back.
    segment_ids: [B, T] int, 1-indexed packed documents, 0 = padding.
    cache: [B, W - 1, C] the W - 1 inputs before x (decode / continuation).
    activation: "silu" or None.
    bias: [C] added before the activation.
    context_axis: None, or the mesh axis T is split over when called inside
      `jax.shard_map` (contiguous slices in rank order; segment_ids is this
      rank's slice of the global ids); not combinable with `cache`.

  Returns:
    Without `cache`: y [B, T, C] in x.dtype. With `cache`: (y, new_cache),
    new_cache [B, W - 1, C] in x.dtype holding the last W - 1 inputs of the
    last run (zeros elsewhere), to pass with the next piece.

  Raises:
    ValueError: a bad shape, dtype or activation (the message names it).
  """
  _validate(x, w, segment_ids, cache, activation, bias)
  if context_axis is not None:
    if cache is not None:
      raise NotImplementedError(
          "short_conv1d with context_axis does not take a decode cache; the"
          " sequence start lives on rank 0. Pass cache=None.")
    return _short_conv1d_context_parallel(
        x, w, context_axis=context_axis, segment_ids=segment_ids,
        activation=activation, bias=bias)
  b, t, c = x.shape
  width = w.shape[0]
  ids = (jnp.ones((b, t), jnp.int32) if segment_ids is None
         else segment_ids.astype(jnp.int32))
  if cache is None:  # the sequence starts here: nothing before it
    prefix = jnp.zeros((b, width - 1, c), x.dtype)
    prefix_ids = jnp.zeros((b, width - 1), jnp.int32)
  else:  # the cache continues the run of x's first non-padding token
    prefix = cache.astype(x.dtype)
    # In an all-padding row, -1 (no real id) carries the cache through.
    first = _first_nonzero(ids)
    first = jnp.where(first != 0, first, -1)
    prefix_ids = jnp.broadcast_to(first[:, None], (b, width - 1))
  xe = jnp.concatenate([prefix, x], axis=1)  # [B, W - 1 + T, C]
  ide = jnp.concatenate([prefix_ids, ids], axis=1)

  # float32 accumulation (float64 when x or w is float64).
  acc_dtype = jnp.promote_types(
      jnp.float32, jnp.promote_types(x.dtype, w.dtype))
  wf = w.astype(acc_dtype)
  acc = jnp.zeros((b, t, c), acc_dtype)
  intact = jnp.ones((b, t), bool)  # no other run between source and target
  for s in range(width):  # s = steps back from the current token
    start = width - 1 - s
    src, src_ids = xe[:, start:start + t], ide[:, start:start + t]
    intact = intact & ((src_ids == 0) | (src_ids == ids))
    visible = intact & (src_ids == ids)
    acc = acc + jnp.where(visible[..., None], src.astype(acc_dtype),
                          0.0) * wf[width - 1 - s]
  if bias is not None:
    acc = acc + bias.astype(acc_dtype)
  if activation == "silu":
    acc = jax.nn.silu(acc)
  y = jnp.where((ids != 0)[..., None], acc, 0.0).astype(x.dtype)
  if cache is None:
    return y
  return y, _last_run_tail(xe, ide, width)


def _short_conv1d_context_parallel(
    x, w, *, context_axis: str, segment_ids=None, activation="silu",
    bias=None):
  """`short_conv1d` on this rank's slice of T: a W - 1 token halo.

  Called inside `jax.shard_map` with T split over the mesh axis `context_axis`
  (contiguous slices, rank order = sequence order). A token needs the W - 1
  inputs before it, which may live on earlier ranks (on several when W - 1 is
  longer than a shard). Each rank contributes its last m = min(W - 1, T_local)
  inputs and their segment ids to one `all_gather`; concatenated in rank order
  these hold, for every rank, the W - 1 tokens before it (from rank r - 1 when
  m = W - 1, else whole shards of as many preceding ranks as needed; zeros with
  id 0, "no token", before the sequence start). The rank then runs the
  single-device conv on [halo | x] with ids [halo ids | segment_ids] and keeps
  the last T_local outputs: the segment rules (a token sees only earlier
  tokens of its own run) are those of `ops.short_conv`, applied to the real
  global ids. Gradients flow back through the gather to the ranks that own
  the halo tokens.

  Communication per rank: R * min(W - 1, T_local) * (C + 1) values received.

  Args:
    x: [B, T_local, C] this rank's inputs.
    w: [W, C] taps (the same on every rank).
    context_axis: the mesh axis T is split over.
    segment_ids: [B, T_local] this rank's slice of the global ids.
    activation, bias: as in `ops.short_conv1d`.

  Returns:
    y [B, T_local, C], the global result on this rank's slice.
  """
  num_ranks = axes.axis_size(context_axis)
  b, t, c = x.shape
  width = w.shape[0]
  ids = (jnp.ones((b, t), jnp.int32) if segment_ids is None
         else segment_ids.astype(jnp.int32))
  if width == 1:  # no halo needed
    return short_conv1d(x, w, segment_ids=segment_ids,
                                   activation=activation, bias=bias)
  halo = width - 1
  m = min(halo, t)
  tails = jax.lax.all_gather(x[:, t - m:], context_axis)  # [R, B, m, C]
  tail_ids = jax.lax.all_gather(ids[:, t - m:], context_axis)  # [R, B, m]
  stream = jnp.moveaxis(tails, 0, 1).reshape(b, num_ranks * m, c)
  stream_ids = jnp.moveaxis(tail_ids, 0, 1).reshape(b, num_ranks * m)
  # Zeros (id 0: no token) before the sequence start, then every rank's tail.
  stream = jnp.pad(stream, ((0, 0), (halo, 0), (0, 0)))
  stream_ids = jnp.pad(stream_ids, ((0, 0), (halo, 0)))
  # The W - 1 tokens before this rank end at stream position R_before * m.
  start = jax.lax.axis_index(context_axis) * m
  prev = jax.lax.dynamic_slice_in_dim(stream, start, halo, axis=1)
  prev_ids = jax.lax.dynamic_slice_in_dim(stream_ids, start, halo, axis=1)
  y = short_conv1d(
      jnp.concatenate([prev.astype(x.dtype), x], axis=1), w,
      segment_ids=jnp.concatenate([prev_ids, ids], axis=1),
      activation=activation, bias=bias)
  return y[:, halo:]
