"""`kimi_delta_attention`: validate, resolve the backend, dispatch (one match).

Kimi Delta Attention (Kimi Linear, arXiv 2510.26692). Per value head, with
state S in R^{K x V}, alpha_t = exp(g_t) and beta_t in [0, 1]:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

Grouped value heads (GVA, flash-linear-attention's `num_v_heads`): v, g, beta
and the states carry HV heads, a multiple of q and k's H; value head j reads
q/k head j // (HV / H). Every backend runs them by repeating q and k along the
head axis before dispatch (autodiff sums the repeats back), so the recurrence
code sees one q/k head per value head.

Negative eigenvalues (`allow_neg_eigval=True`; Grazzi et al., arXiv
2411.12537): beta in [0, 2], so the transition I - beta k k^T (unit k) has
the eigenvalue 1 - beta in [-1, 1]. The algebra of every backend holds for
any beta; the flag only widens the accepted range.

Chunk-boundary states (`output_chunk_states=True`): the state after tokens
C, 2 C, ... (C = `chunk_states_every`) of each row, differentiable, with
packed segments (the state of the segment holding the boundary token) and
under context parallelism (global positions; each rank returns those in its
slice). Computed by the exact state passing of
`linear_attention.ops.kda.context_parallel.chunk_states` on the backend's
own runner: about one extra forward pass with V + K value columns.
"""

import functools

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops import checks
from linear_attention.ops import context_axis as axes
from linear_attention.ops.kda import chunked
from linear_attention.ops.kda import common
from linear_attention.ops.kda import context_parallel
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import precision as precision_lib
from linear_attention.ops.kda import reference


Backend = backends.Backend
CHUNK_SIZES = chunked.CHUNK_SIZES  # `chunk_size` of the chunked backend

LOWER_BOUND_MIN = -5.0


def validate_lower_bound(lower_bound: float | None, name="lower_bound") -> None:
  """Raises ValueError unless lower_bound is None or a float in [-5, 0)."""
  checks.finite_in(name, lower_bound, LOWER_BOUND_MIN, 0, optional=True)


def _validate(q, k, v, g, beta, *, scale, a_log, dt_bias, lower_bound,
              use_gate_in_kernel, initial_state, output_final_state,
              segment_ids, max_num_segments, allow_neg_eigval=False):
  checks.rank("q", q, 4, "[B, T, H, K]")
  b, t, h, kd = q.shape
  checks.rank("v", v, 4, "[B, T, HV, V]")
  hv, vd = v.shape[-2:]
  if t < 1 or b < 1 or h < 1 or kd < 1 or vd < 1:
    raise ValueError(
        f"q and v need B, T, H, K, V >= 1; got q {tuple(q.shape)}, v"
        f" {tuple(v.shape)}.")
  checks.shape("k", k, (b, t, h, kd), "[B, T, H, K] like q")
  if v.shape[:2] != (b, t) or hv < h or hv % h:
    raise ValueError(
        f"v must have shape [B, T, HV, V] with q's B, T and HV (value heads)"
        f" a positive multiple of q's H = {h}; got {tuple(v.shape)}.")
  h = hv  # from here on, every per-head argument follows the value heads
  checks.shape("g", g, (b, t, h, kd), "[B, T, HV, K]")
  checks.shape("beta", beta, (b, t, h), "[B, T, HV]")
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    checks.floating(name, x)
  checks.positive_number("scale", scale, optional=True)
  validate_lower_bound(lower_bound)
  if use_gate_in_kernel:
    if a_log is None:
      raise ValueError(
          "a_log ([H]) is required when use_gate_in_kernel=True.")
    checks.shape("a_log", a_log, (h,), "[HV]")
    checks.shape("dt_bias", dt_bias, (h * kd,), "[HV * K]")
  if segment_ids is not None:
    checks.shape("segment_ids", segment_ids, (b, t), "[B, T]")
    checks.integer_array("segment_ids", segment_ids)
    if max_num_segments is None and (initial_state is not None
                                     or output_final_state):
      raise ValueError(
          "max_num_segments (static N >= 1) is required when segment_ids is"
          " used with initial_state or output_final_state=True.")
  checks.int_at_least("max_num_segments", max_num_segments, 1, optional=True)
  if initial_state is not None:
    if segment_ids is None:
      checks.shape("initial_state", initial_state, (b, h, kd, vd),
                   "[B, HV, K, V]")
    else:
      checks.shape("initial_state", initial_state,
                   (b, max_num_segments, h, kd, vd),
                   "[B, max_num_segments, HV, K, V] with segment_ids")
  checks.boolean("allow_neg_eigval", allow_neg_eigval)
  checks.values_in("beta", beta, 0.0, 2.0 if allow_neg_eigval else 1.0,
                   hint="" if allow_neg_eigval else
                   " (allow_neg_eigval=True accepts [0, 2])")


def kimi_delta_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    a_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float | None = None,
    use_gate_in_kernel: bool = False,
    use_qk_l2norm: bool = False,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    max_num_segments: int | None = None,
    allow_neg_eigval: bool = False,
    output_chunk_states: bool = False,
    chunk_states_every: int = 64,
    backend: str | Backend = "chunked",
    context_axis: str | None = None,
    chunk_size: int | None = None,
    group_width: int | None = None,
    precision: "str | precision_lib.Precisions" = "auto",
) -> tuple[jax.Array, ...]:
  """Kimi Delta Attention over [B, T, H, *] inputs.

  Args:
    q, k: [B, T, H, K] queries and keys.
    v: [B, T, HV, V] values; HV (value heads) a multiple of H, value head j
      reading q/k head j // (HV / H) (grouped value heads; HV = H usually).
    g: [B, T, HV, K] log decay (<= 0), or the raw gate when
      `use_gate_in_kernel=True`.
    beta: [B, T, HV] write strength in [0, 1] ([0, 2] with
      `allow_neg_eigval`); checked when concrete, not under jit.
    scale: query scale; default K ** -0.5.
    a_log: [HV] log decay rate; required when `use_gate_in_kernel=True`.
    dt_bias: [HV * K] bias added to the raw gate (fused gate only).
    lower_bound: None for the gate `-exp(a_log) * softplus(g + dt_bias)`,
      else `lower_bound * sigmoid(exp(a_log) * (g + dt_bias))`, in [-5, 0).
    use_gate_in_kernel: whether `g` is raw and activated here.
    use_qk_l2norm: L2-normalise q and k (x / sqrt(sum x^2 + 1e-6)).
    initial_state: [B, HV, K, V]; with `segment_ids`, [B, N, HV, K, V].
    output_final_state: also return the final state (same shape), in the
      compute dtype: float32, or float64 for float64 inputs on `reference`
      and `chunked` (with `jax_enable_x64`).
    segment_ids: [B, T] int, 1-indexed packed documents, 0 = padding.
    max_num_segments: static N; required with segment_ids and states.
    allow_neg_eigval: accept beta in [0, 2] (transition eigenvalues in
      [-1, 1]; see the module docstring).
    output_chunk_states: also return the states after every
      `chunk_states_every`-th token (see Returns); "reference" and "chunked"
      only (NotImplementedError on "mosaic").
    chunk_states_every: C >= 1, the distance between those states (under
      `context_axis`, each rank's T must be a multiple of C).
    backend: "reference" | "chunked" | "mosaic" | "auto" (or a `Backend`);
      resolved here, once, by `linear_attention.ops.backends.resolve`
      ("auto": mosaic on TPU v6+, chunked elsewhere). A decode piece (an
      `initial_state`, T shorter than a chunk: 16 on CPU, 64 elsewhere)
      runs the token recurrence; one for "mosaic" with T not a multiple of
      64 (and no `segment_ids`) runs on chunked.
    context_axis: None, or the name of a mesh axis when called inside
      `jax.shard_map` with T split over it (contiguous slices in rank order;
      segment_ids is this rank's slice of the global ids; initial_state and
      the final state are global, the same on every rank). The result is the
      global one on this rank's slice, by exact state passing
      (`linear_attention.ops.kda.context_parallel`); "mosaic" uses
      tokamax's CP path and raises NotImplementedError for its limits.
    chunk_size: tokens per chunk of "chunked": 16 or 64; None is the
      platform's (`backends.chunk_size`: 16 on CPU, 64 elsewhere). "mosaic"
      takes only 64 (NotImplementedError otherwise); "reference" ignores it.
    group_width: chunk-heads x K per step of "chunked"'s grouped scan (an
      int >= 1; None: `chunked.grouped.GROUP_WIDTH`); other backends ignore
      it. Both change the schedule, not the result beyond rounding.
    precision: the precision of the op's matmuls, pinned whatever the
      process default (`jax.default_matmul_precision`) is: "auto" (float32
      accurate for float32/float64 inputs, one bfloat16 pass for
      bfloat16/float16 inputs), "highest", "high", "default" (that
      `jax.lax.Precision` on every matmul), or a
      `linear_attention.ops.kda.precision.Precisions` (per group of
      matmuls). Only TPUs and GPUs (TF32) read it: a CPU computes float32
      products exactly. "mosaic" takes only "auto" (tokamax's kernel pins
      its own). See `linear_attention/ops/kda/precision.py`.

  Returns:
    (o [B, T, HV, V] in q.dtype, final_state or None); with
    `output_chunk_states`, a third element [B, T // C, HV, K, V] in the
    final state's dtype: entry j is the state right after token (j + 1) C - 1
    (the state of the segment holding that token; zeros if it is padding).
    Under `context_axis`, [B, T_local // C, HV, K, V]: the boundaries in this
    rank's slice.

  Raises:
    ValueError: bad input (the message names the argument).
    NotImplementedError: the backend cannot take this input.
  """
  Backend.parse(backend)  # ValueError: not a backend name
  precision_lib.validate(precision)  # ValueError: not a precision
  if context_axis is not None:
    axes.axis_size(context_axis)  # ValueError: not a bound axis
  _validate(q, k, v, g, beta, scale=scale, a_log=a_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
            initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids,
            max_num_segments=max_num_segments,
            allow_neg_eigval=allow_neg_eigval)
  # The one decision. A decode piece continues a state where a chunked form
  # would pad it: any T without segments (Mosaic takes only multiples of
  # 64), a piece shorter than a chunk with them; never a context-parallel
  # shard (a slice of a long sequence).
  t = q.shape[1]
  decode = initial_state is not None and context_axis is None and (
      segment_ids is None or t < backends.MOSAIC_CHUNK)
  backend = backends.resolve(backend, decode_len=t if decode else None)
  tuning = _tuning(backend, chunk_size, group_width, precision, q.dtype)
  if scale is None:
    scale = q.shape[-1] ** -0.5
  _check_chunk_states(output_chunk_states, chunk_states_every, backend,
                      t_local=q.shape[1], context_axis=context_axis)
  group = v.shape[2] // q.shape[2]
  if group > 1:  # grouped value heads: one q/k head per value head
    q, k = (jnp.repeat(x, group, axis=2) for x in (q, k))
  kwargs = dict(
      scale=scale, a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound,
      use_gate_in_kernel=use_gate_in_kernel, use_qk_l2norm=use_qk_l2norm,
      initial_state=initial_state, output_final_state=output_final_state,
      segment_ids=segment_ids, max_num_segments=max_num_segments)
  if context_axis is not None and backend is Backend.MOSAIC:
    return mosaic.kda_mosaic_context_parallel(
        q, k, v, g, beta, context_axis=context_axis, **kwargs)
  local_fn = functools.partial(_run, backend, **tuning)
  if context_axis is not None:
    return context_parallel.kda_context_parallel(
        q, k, v, g, beta, context_axis=context_axis, local_fn=local_fn,
        chunk_states_every=(chunk_states_every if output_chunk_states
                            else None), **kwargs)
  out = local_fn(q, k, v, g, beta, **kwargs)
  if not output_chunk_states:
    return out
  states = context_parallel.chunk_states(
      q, k, v, g, beta, every=chunk_states_every, local_fn=local_fn,
      local=kwargs, initial_state=initial_state, segment_ids=segment_ids,
      dtype=common.compute_dtype(q, k, v, g, beta, initial_state))
  return out + (states,)


def _check_chunk_states(output_chunk_states, every, backend, *, t_local,
                        context_axis) -> None:
  """ValueError / NotImplementedError for a chunk-state request."""
  checks.boolean("output_chunk_states", output_chunk_states)
  if not output_chunk_states:
    return
  checks.int_at_least("chunk_states_every", every, 1)
  if context_axis is not None and t_local % every:
    raise ValueError(
        f"chunk_states_every ({every}) must divide each rank's sequence"
        f" length under context_axis; got T_local = {t_local}.")
  if backend is Backend.MOSAIC:
    raise NotImplementedError(
        "output_chunk_states is implemented on the 'reference' and"
        " 'chunked' backends, not 'mosaic' (tokamax's kernel returns no"
        " intermediate states).")


def _tuning(backend: Backend, chunk_size, group_width, precision,
            dtype) -> dict:
  """The backend's schedule and precision arguments, checked."""
  checks.one_of("chunk_size", chunk_size, CHUNK_SIZES, optional=True)
  checks.int_at_least("group_width", group_width, 1, optional=True)
  if backend is Backend.MOSAIC and chunk_size not in (None, mosaic.CHUNK):
    raise NotImplementedError(
        f"backend='mosaic' runs tokamax's kernel on {mosaic.CHUNK}-token"
        f" chunks; got chunk_size={chunk_size}.")
  if backend is Backend.MOSAIC:
    if precision != "auto":
      raise NotImplementedError(
          "backend='mosaic' runs tokamax's kernel, which pins its own matmul"
          f" precision; precision must be 'auto', got {precision!r}.")
    return {}
  resolved = precision_lib.resolve(precision, dtype)
  if backend is Backend.REFERENCE:
    return dict(precision=resolved)
  return dict(chunk_size=chunk_size, group_width=group_width,
              precision=resolved)


def resolved_backend(backend: "str | Backend" = "auto", *,
                     device_kind: str | None = None) -> str:
  """The backend `kimi_delta_attention(..., backend=backend)` runs, by name.

  For a call that does not continue a state (never "auto"), on this host,
  on the target of `mosaic.lowering_mode` in context, or on `device_kind`
  (e.g. "TPU v6 lite"): what experiments record and report.
  """
  return backends.resolve(backend, device_kind=device_kind).value


def may_run_mosaic(backend: "str | Backend") -> bool:
  """Whether a program built with `backend` may run tokamax's Pallas kernel.

  "mosaic", and "auto" (Mosaic on the TPU v6+ the program is compiled for,
  which may be another machine: `mosaic.lowering_mode`). Such a program is
  traced without shard_map's `check_vma`, which the kernel does not support.
  """
  return Backend.parse(backend) in (Backend.MOSAIC, Backend.AUTO)


def runs_interpreted(backend: "str | Backend") -> bool:
  """Whether `backend` runs tokamax's kernel in Pallas interpret mode here.

  True when it resolves to "mosaic" and this host is not a TPU: the kernel
  then runs only inside `mosaic.interpreted()`, which the caller sets up
  (`experiments.interpret.interpret_mode`; seconds per call, tiny shapes).
  """
  return (resolved_backend(backend) == Backend.MOSAIC.value
          and jax.default_backend() != "tpu")


def _run(backend: Backend, q, k, v, g, beta, **kwargs):
  """The backend's single-device runner on validated arguments."""
  match backend:
    case Backend.REFERENCE:
      return reference.kda_reference(q, k, v, g, beta, **kwargs)
    case Backend.CHUNKED:
      return chunked.kda_chunked(q, k, v, g, beta, **kwargs)
    case Backend.MOSAIC:
      return mosaic.kda_mosaic(q, k, v, g, beta, **kwargs)
