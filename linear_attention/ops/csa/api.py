"""`csa_streamindex_score`: validate, resolve the backend, run.

DeepSeek-V4 Compressed Sparse Attention (CSA) StreamIndex indexer score
(DeepSeek-V4 inference code, `Indexer`; MaxText
`kernels/attention/csa_streamindex.py`). With c = softmax_scale:

    score[b, s, w] = c sum_h weights[b, s, h] relu(q[b, s, h, :] . k[b, w, :])

Block w (one compressed key per `compress_rate` tokens) is visible to query s
iff `block_last_positions[b, w] <= q_positions[b, s]` (a block becomes
visible at its own last token) and, when segment ids are given, the two ids
are equal; invisible entries are -inf and get a zero gradient.

Precision (`linear_attention.ops.precision`): the products q . k and their
gradients run at the call's `precision` ("auto": HIGHEST for float32 inputs,
one bfloat16 pass for bfloat16), whatever `jax.default_matmul_precision`
says; the head sums over float32 relu(A) are float32-exact in every backend
(HIGHEST in the XLA ones, elementwise in the Pallas kernels).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linear_attention.ops import backends
from linear_attention.ops import checks
from linear_attention.ops import precision as precision_lib
from linear_attention.ops.csa import common
from linear_attention.ops.csa import pallas
from linear_attention.ops.csa import reference
from linear_attention.ops.csa import xla_chunked

# The score's backends (`linear_attention.ops.backends`), each returning
# float32 [B, S, W]: "reference" (one einsum over [B, S, H, W]: the oracle),
# "xla_chunked" (query tiles x head chunks, custom VJP), "pallas" (fused
# forward/backward Pallas kernels, TPU). No "auto": the caller names one.
BACKENDS = backends.Registry("CSA", (reference, xla_chunked, pallas))


def _check(name, x, shape, what, *, integer=False):
  checks.shape(name, x, shape, what)
  (checks.integer_array if integer else checks.floating)(name, x)


def _validate(q, k, w, *, softmax_scale, compress_rate, q_positions,
              block_last_positions, q_segment_ids, kv_segment_ids, backend,
              precision, options):
  checks.rank("q", q, 4, "[B, S, H, D]")
  b, s, h, d = q.shape
  checks.rank("k_compressed", k, 3, "[B, W, D]")
  nw = k.shape[1]
  if min(b, s, h, d, nw) < 1:
    raise ValueError(f"q and k_compressed need B, S, H, D, W >= 1; got q"
                     f" {tuple(q.shape)}, k_compressed {tuple(k.shape)}.")
  _check("q", q, q.shape, "[B, S, H, D]")
  _check("k_compressed", k, (b, nw, d), "[B, W, D] with q's B and D")
  _check("weights", w, (b, s, h), "[B, S, H]")
  if not (checks.is_number(softmax_scale) and math.isfinite(softmax_scale)):
    raise ValueError(
        f"softmax_scale must be a finite number; got {softmax_scale!r}.")
  checks.int_at_least("compress_rate", compress_rate, 1)
  if q_positions is not None:
    _check("q_positions", q_positions, (b, s), "[B, S]", integer=True)
  if block_last_positions is not None:
    _check("block_last_positions", block_last_positions, (b, nw), "[B, W]",
           integer=True)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given"
                     " together (or neither).")
  if q_segment_ids is not None:
    _check("q_segment_ids", q_segment_ids, (b, s), "[B, S]", integer=True)
    _check("kv_segment_ids", kv_segment_ids, (b, nw), "[B, W]", integer=True)
  precision_lib.validate(precision)
  for name in ("block_q", "block_w", "head_chunk"):
    checks.int_at_least(name, options.get(name), 1, optional=True)
  for name in options:  # the tuning arguments given
    takers = [n for n, b in BACKENDS.backends.items() if name in b.OPTIONS]
    if name not in BACKENDS.backends[backend].OPTIONS:
      raise ValueError(f"{name} applies only to backend in {takers}; got"
                       f" backend={backend!r}.")


def csa_streamindex_score(
    q: jax.Array,
    k_compressed: jax.Array,
    weights: jax.Array,
    *,
    softmax_scale: float,
    compress_rate: int,
    q_positions: jax.Array | None = None,
    block_last_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    backend: str = "reference",
    precision: str = "auto",
    interpret: bool | None = None,
    block_q: int | None = None,
    block_w: int | None = None,
    head_chunk: int | None = None,
) -> jax.Array:
  """DeepSeek-V4 CSA indexer score, float32 [B, S, W] (see module docstring).

  Args:
    q: [B, S, H, D] indexer queries.
    k_compressed: [B, W, D] one key per compressed block.
    weights: [B, S, H] per-head weights (may be negative).
    softmax_scale: c, multiplies the head sum (DeepSeek-V4: D ** -0.5).
    compress_rate: r, tokens per block; used for the default block positions.
    q_positions: [B, S] int; default arange(S).
    block_last_positions: [B, W] int, the position of each block's last
      token; default (w + 1) * r - 1.
    q_segment_ids, kv_segment_ids: [B, S], [B, W] int (together or neither);
      packed documents: a block is visible only inside its own segment.
    backend: "reference" | "xla_chunked" | "pallas" (`BACKENDS`).
    precision: of the q . k products, forward and backward: "auto" (HIGHEST
      for float32 / float64 q, DEFAULT for bfloat16 / float16), "highest",
      "high" or "default" (`linear_attention.ops.precision`).
    interpret: pallas only; True runs Pallas interpret mode on any device,
      None compiles with Mosaic (TPU only: NotImplementedError elsewhere).
    block_q: query rows per tile (xla_chunked, pallas).
    block_w: blocks per tile (pallas only).
    head_chunk: heads per inner step (xla_chunked, pallas); divides H.

  Returns:
    float32 [B, S, W]; -inf where invisible. A query that sees no block gets
    a row of -inf and a zero gradient.

  Raises:
    ValueError: bad input (the message names the argument).
    NotImplementedError: the backend cannot take these tiles.
  """
  backend = BACKENDS.parse(backend)
  options = {name: value for name, value in (
      ("block_q", block_q), ("block_w", block_w), ("head_chunk", head_chunk),
      ("interpret", interpret)) if value is not None}
  _validate(q, k_compressed, weights, softmax_scale=softmax_scale,
            compress_rate=compress_rate, q_positions=q_positions,
            block_last_positions=block_last_positions,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            backend=backend, precision=precision, options=options)
  b, s = q.shape[:2]
  nw = k_compressed.shape[1]
  if q_positions is None:
    q_positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  if block_last_positions is None:
    block_last_positions = jnp.broadcast_to(
        (jnp.arange(nw, dtype=jnp.int32) + 1) * compress_rate - 1, (b, nw))
  call = common.Call(
      q=q, k_compressed=k_compressed, weights=weights,
      softmax_scale=softmax_scale, q_positions=q_positions,
      block_last_positions=block_last_positions, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      precision=precision_lib.for_dtype(precision, q.dtype), options=options,
      target=backends.target())
  return BACKENDS.resolve(backend, call).run(call)


def csa_streamindex_score_sharded(
    mesh: jax.sharding.Mesh,
    data_axes: str | tuple[str, ...],
    q: jax.Array,
    k_compressed: jax.Array,
    weights: jax.Array,
    **kwargs,
) -> jax.Array:
  """`csa_streamindex_score` with the batch split over data-parallel mesh axes.

  Every array argument is split on its batch dimension over `data_axes`
  with `jax.shard_map`; each device scores its own rows, so the result
  equals the unsharded call. Sequence / context axes are never split here
  (the score of a query needs every block before it); the remaining mesh
  axes see replicated inputs.

  Args:
    mesh: the device mesh.
    data_axes: mesh axis name(s) that split the batch.
    q, k_compressed, weights: as `csa_streamindex_score`.
    **kwargs: the keyword arguments of `csa_streamindex_score` (checked there).

  Returns:
    float32 [B, S, W], batch-sharded over `data_axes`.

  Raises:
    ValueError: an unknown axis, or B not divisible by the axes' size.
  """
  axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  if not axes:
    raise ValueError("data_axes must name at least one mesh axis.")
  for a in axes:
    if a not in mesh.shape:
      raise ValueError(f"data_axes entry {a!r} is not a mesh axis; mesh has"
                       f" {tuple(mesh.shape)}.")
  n = math.prod(mesh.shape[a] for a in axes)
  if getattr(q, "ndim", 0) < 1 or q.shape[0] % n:
    raise ValueError(f"q's batch {getattr(q, 'shape', (None,))[0]} must be"
                     f" divisible by the data_axes size {n}.")
  arrays = {name: kwargs.pop(name) for name in
            ("q_positions", "block_last_positions", "q_segment_ids",
             "kv_segment_ids") if kwargs.get(name) is not None}
  names = tuple(arrays)
  spec = P(axes)

  def local(q, k, w, *extra):
    return csa_streamindex_score(q, k, w, **dict(zip(names, extra)), **kwargs)

  # check_vma=False: the backends' loops start from fresh (unvarying) zero
  # carries; every input and the output are split the same way, so the
  # per-device result is the unsharded one for its rows.
  f = jax.shard_map(local, mesh=backends.target_mesh(mesh),
                    in_specs=(spec,) * (3 + len(names)), out_specs=spec,
                    check_vma=False)
  return f(q, k_compressed, weights, *arrays.values())
