"""Context parallelism for the short convolution: a W - 1 token halo.

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
"""

import jax
import jax.numpy as jnp

from linear_attention.parallel import kda_cp


def short_conv1d_context_parallel(
    x, w, *, context_axis: str, segment_ids=None, activation="silu",
    bias=None, sequence_layout: str = "contiguous",
):
  """`ops.short_conv1d` on this rank's slice of T; see the module docstring.

  Args:
    x: [B, T_local, C] this rank's inputs.
    w: [W, C] taps (the same on every rank).
    context_axis: the mesh axis T is split over.
    segment_ids: [B, T_local] this rank's slice of the global ids.
    activation, bias: as in `ops.short_conv1d`.
    sequence_layout: only "contiguous" (see `kda_cp.check_sequence_layout`).

  Returns:
    y [B, T_local, C], the global result on this rank's slice.
  """
  from linear_attention.ops import short_conv  # pylint: disable=g-import-not-at-top

  kda_cp.check_sequence_layout(sequence_layout)
  num_ranks = kda_cp.context_axis_size(context_axis)
  b, t, c = x.shape
  width = w.shape[0]
  ids = (jnp.ones((b, t), jnp.int32) if segment_ids is None
         else segment_ids.astype(jnp.int32))
  if width == 1:  # no halo needed
    return short_conv.short_conv1d(x, w, segment_ids=segment_ids,
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
  y = short_conv.short_conv1d(
      jnp.concatenate([prev.astype(x.dtype), x], axis=1), w,
      segment_ids=jnp.concatenate([prev_ids, ids], axis=1),
      activation=activation, bias=bias)
  return y[:, halo:]
