"""Data + context parallel losses over a jax.sharding.Mesh.

`shard_loss_fn` turns a per-shard loss into the global one: the batch is
split over `data_axis` (dim 0) and the sequence over `context_axis` (dim 1),
the parameters are replicated, and the shard sums are combined with one psum
over both axes. Layers inside `loss_fn` that mix tokens must be told the
context axis (`KimiDeltaAttention(context_axis=...)`, `ops.short_conv1d(...,
context_axis=...)`); per-token layers need nothing. Take gradients of the
returned function (outside the shard_map): they are the single-device ones.

The sequence is split in contiguous slices, rank order = sequence order, the
only layout that is exact for a recurrence (`linear_attention.ops.context_axis`).
Targets must be aligned with their positions before sharding (e.g. next-token
labels shifted on the full sequence), so no token crosses a rank for them.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from linear_attention.ops import backends
from linear_attention.ops import checks


def shard_loss_fn(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
    mesh: jax.sharding.Mesh,
    data_axis: str | None = "data",
    context_axis: str | None = "context",
    *,
    has_aux: bool = False,
    check_vma: bool = True,
) -> Callable[[Any, Any], Any]:
  """Wraps a shard loss as the global mean loss over a data x context mesh.

  Args:
    loss_fn: `(params, batch) -> (loss_sum, weight_sum)` on one shard, where
      every leaf of `batch` is this rank's [B_local, T_local, ...] block and
      loss_sum is the sum of the per-token losses (weight_sum their count or
      total weight). With `has_aux`, `(loss_sum, weight_sum, aux_sums)`,
      where aux_sums is a pytree of per-token sums (e.g. correct tokens).
    mesh: the mesh; must have the named axes.
    data_axis: mesh axis the batch (dim 0) is split over, or None.
    context_axis: mesh axis the sequence (dim 1) is split over, or None.
    has_aux: whether `loss_fn` also returns `aux_sums`.
    check_vma: `jax.shard_map`'s type checking of values varying over mesh
      axes. Keep True; pass False when `loss_fn` calls kernels that cannot
      be traced under it (tokamax's Pallas kernels: KDA `backend="mosaic"`).
      Values and gradients are the same either way.

  Returns:
    `f(params, batch) -> psum(loss_sum) / psum(weight_sum)`, a replicated
    scalar; `jax.grad(f)` gives the single-device gradients. With
    `has_aux`, `f` returns `(loss, aux)`, aux = psum(aux_sums) /
    psum(weight_sum) leaf by leaf (use `jax.grad(f, has_aux=True)`).

  Raises:
    ValueError: an axis that is not a str naming an axis of `mesh`.
  """
  for name, axis in (("data_axis", data_axis),
                     ("context_axis", context_axis)):
    checks.mesh_axis_name(name, axis, axes=mesh.axis_names)
  axes = tuple(a for a in (data_axis, context_axis) if a is not None)

  def local(params, batch):
    loss_sum, weight_sum, *aux = loss_fn(params, batch)
    if len(aux) != int(has_aux):
      raise ValueError(
          f"loss_fn must return {3 if has_aux else 2} values with has_aux="
          f"{has_aux}; got {2 + len(aux)}.")
    weight = jax.lax.psum(weight_sum, axes)
    loss = jax.lax.psum(loss_sum, axes) / weight
    if not has_aux:
      return loss
    return loss, jax.tree.map(lambda x: jax.lax.psum(x, axes) / weight,
                              aux[0])

  def sharded(params, batch):
    # The mesh is looked up when traced: lowering for another machine runs
    # on the abstract mesh that stands for `mesh` there.
    return jax.shard_map(
        local, mesh=backends.target_mesh(mesh),
        in_specs=(P(), P(data_axis, context_axis)), out_specs=P(),
        check_vma=check_vma)(params, batch)

  return sharded
