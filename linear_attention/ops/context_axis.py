"""The mesh axis an op's sequence is split over (context parallelism).

An op called with `context_axis=name` inside `jax.shard_map` expects T split
over that mesh axis in contiguous slices, rank order = sequence order. Only
that layout is exact for a recurrence: a load-balanced ("zig-zag") layout,
where rank r holds chunks r and 2R - 1 - r, breaks the left-to-right order
the state is passed in, so the ops take no layout argument.
"""

import jax

from linear_attention.ops import checks


def axis_size(context_axis, name: str = "context_axis") -> int:
  """The size of a bound mesh axis; ValueError if it is not a str or unbound."""
  checks.mesh_axis_name(name, context_axis)
  if context_axis is None:
    raise ValueError(f"{name} must name a bound mesh axis here; got None.")
  try:
    return jax.lax.axis_size(context_axis)
  except NameError:
    raise ValueError(
        f"{name}={context_axis!r} is not a bound mesh axis: call this inside"
        " `jax.shard_map` over a mesh that has that axis, with T split over"
        " it.") from None
