"""`kimi_delta_attention`: validate, resolve the backend, run.

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
slice). The XLA backends compute them by the exact state passing of
`linear_attention.ops.kda.context_parallel.chunk_states` on their own
runner (about one extra forward pass with V + K value columns); "pallas"
writes them from its kernels' one pass where C is a multiple of its chunk
and there are no per-segment states or context axis
(`pallas.one_pass_chunk_states`), else by that state passing.
"""

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.ops import backends
from linear_attention.ops import checks
from linear_attention.ops import context_axis as axes
from linear_attention.ops.kda import chunked
from linear_attention.ops.kda import common
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import pallas
from linear_attention.ops.kda import precision as precision_lib
from linear_attention.ops.kda import reference
from linear_attention.ops.kda import tokamax_kernel

# The op's backends: one module each (`linear_attention.ops.backends`). A new
# backend is its module, one entry here, and its place in `preference`.
BACKENDS = backends.Registry(
    "KDA", (reference, chunked, tokamax_kernel, pallas),
    # "mosaic": tokamax's kernel's name in older configs and saved runs.
    aliases={"mosaic": tokamax_kernel.NAME},
    preference={"tpu": (pallas.NAME, tokamax_kernel.NAME, chunked.NAME),
                "default": (chunked.NAME,)})
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
  if not use_gate_in_kernel:
    checks.values_in("g", g, -np.inf, 0.0,
                     hint=" (a log decay; use_gate_in_kernel=True takes the"
                     " raw gate)")
  if segment_ids is not None:
    checks.values_in("segment_ids", segment_ids, 0,
                     np.inf if max_num_segments is None else max_num_segments,
                     hint=" (0 = padding" + (
                         "" if max_num_segments is None else
                         ", at most max_num_segments") + ")")


def _traced_bad_rows(g, beta, segment_ids, *, use_gate_in_kernel,
                     allow_neg_eigval, max_num_segments):
  """[B, HV] True where a traced input of that row and head lies outside its
  range (what `_validate` raises for on concrete input); None when nothing
  is traced. The op then returns NaN for those rows (`_poison`)."""
  traced = lambda x: isinstance(x, jax.core.Tracer)
  bad = None
  if traced(beta):
    bad = ~checks.in_range(beta, 0.0, 2.0 if allow_neg_eigval else 1.0)
  if not use_gate_in_kernel and traced(g):
    positive = ~jnp.all(checks.in_range(g, -jnp.inf, 0.0), axis=-1)
    bad = positive if bad is None else bad | positive
  if segment_ids is not None and traced(segment_ids):
    high = jnp.inf if max_num_segments is None else max_num_segments
    ids = ~checks.in_range(segment_ids, 0, high)[:, :, None]
    bad = ids if bad is None else bad | ids
  return None if bad is None else jnp.any(bad, axis=1)


def _poison(result, bad):
  """NaN in every output row, state and chunk state of a bad (row, head)."""
  if bad is None:
    return result
  o, *states = result
  b, hv = bad.shape
  o = jnp.where(bad[:, None, :, None], jnp.nan, o)
  out = []
  for s in states:
    if s is None:
      out.append(s)
      continue
    # [B, HV, K, V], [B, N, HV, K, V] or chunk states [B, T // C, HV, K, V].
    mask = bad.reshape((b,) + (1,) * (s.ndim - 4) + (hv, 1, 1))
    out.append(jnp.where(mask, jnp.nan, s))
  return (o, *out)


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
    backend: str = "chunked",
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
      `chunk_states_every`-th token (see Returns); "reference", "chunked"
      and "pallas" (NotImplementedError on "tokamax").
    chunk_states_every: C >= 1, the distance between those states (under
      `context_axis`, each rank's T must be a multiple of C).
    backend: "reference" | "chunked" | "tokamax" (tokamax's Pallas TPU
      kernel; "mosaic" is accepted for it) | "pallas" (our Pallas TPU
      kernels) | "auto"; resolved here, once, by `resolve` ("auto": the
      first of "pallas", "tokamax", "chunked" that takes the call and does
      not decline it on a TPU, "chunked" elsewhere; "pallas" only in its
      measured class on a v5e). A decode piece (an
      `initial_state`, T shorter than a chunk: 16 on CPU, 64 elsewhere)
      runs the token recurrence; one for "tokamax" with T not a multiple of
      64 runs on "chunked".
    context_axis: None, or the name of a mesh axis when called inside
      `jax.shard_map` with T split over it (contiguous slices in rank order;
      segment_ids is this rank's slice of the global ids; initial_state and
      the final state are global, the same on every rank). The result is the
      global one on this rank's slice, by exact state passing
      (`linear_attention.ops.kda.context_parallel`); "tokamax" uses
      tokamax's CP path and raises NotImplementedError for its limits.
    chunk_size: tokens per chunk of "chunked": 16 or 64; None is the
      platform's (`backends.chunk_size`: 16 on CPU, 64 elsewhere). "tokamax"
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
      products exactly. "tokamax" takes only "auto" (tokamax's kernel pins
      its own). See `linear_attention/ops/kda/precision.py`.

  Returns:
    (o [B, T, HV, V] in q.dtype, final_state or None); with
    `output_chunk_states`, a third element [B, T // C, HV, K, V] in the
    final state's dtype: entry j is the state right after token (j + 1) C - 1
    (the state of the segment holding that token; zeros if it is padding).
    Under `context_axis`, [B, T_local // C, HV, K, V]: the boundaries in this
    rank's slice.

  Raises:
    ValueError: bad input (the message names the argument, the allowed
      range and the offending values: beta outside [0, 1] ([0, 2] with
      allow_neg_eigval), a pre-activated g above 0, segment ids outside
      [0, max_num_segments], NaN anywhere in those).
    NotImplementedError: the backend cannot take this input.

  Traced input (under `jit`, `grad`, ...) cannot be read while tracing.
  There the same ranges are checked on the device instead, and a (row,
  head) with any value outside them (NaN included) gets NaN for its whole
  output row and its final (and chunk) states; a bad segment id poisons
  every head of its row. Valid rows are unaffected.
  """
  backend = BACKENDS.parse(backend)  # ValueError: not a backend name
  precision_lib.validate(precision)  # ValueError: not a precision
  if context_axis is not None:
    axes.axis_size(context_axis)  # ValueError: not a bound axis
  _validate(q, k, v, g, beta, scale=scale, a_log=a_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
            initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids,
            max_num_segments=max_num_segments,
            allow_neg_eigval=allow_neg_eigval)
  _validate_options(output_chunk_states, chunk_states_every, chunk_size,
                    group_width, t_local=q.shape[1], context_axis=context_axis)
  group = v.shape[2] // q.shape[2]
  if group > 1:  # grouped value heads: one q/k head per value head
    q, k = (jnp.repeat(x, group, axis=2) for x in (q, k))
  call = common.Call(
      q=q, k=k, v=v, g=g, beta=beta,
      scale=q.shape[-1] ** -0.5 if scale is None else scale, a_log=a_log,
      dt_bias=dt_bias, lower_bound=lower_bound,
      use_gate_in_kernel=use_gate_in_kernel, use_qk_l2norm=use_qk_l2norm,
      initial_state=initial_state, output_final_state=output_final_state,
      segment_ids=segment_ids, max_num_segments=max_num_segments,
      output_chunk_states=output_chunk_states,
      chunk_states_every=chunk_states_every, context_axis=context_axis,
      chunk_size=chunk_size, group_width=group_width, precision=precision,
      target=_target())
  bad = _traced_bad_rows(g, beta, segment_ids,
                         use_gate_in_kernel=use_gate_in_kernel,
                         allow_neg_eigval=allow_neg_eigval,
                         max_num_segments=max_num_segments)
  if bad is not None and context_axis is not None:
    # A bad value on any rank spoils the whole row's recurrence (and the
    # replicated final state): every rank poisons it alike.
    bad = jax.lax.psum(bad.astype(jnp.int32), context_axis) > 0
  return _poison(resolve(backend, call).run(call), bad)


def _validate_options(output_chunk_states, every, chunk_size, group_width, *,
                      t_local, context_axis) -> None:
  """ValueError for a bad chunk-state request or schedule argument."""
  checks.boolean("output_chunk_states", output_chunk_states)
  if output_chunk_states:
    checks.int_at_least("chunk_states_every", every, 1)
    if context_axis is not None and t_local % every:
      raise ValueError(
          f"chunk_states_every ({every}) must divide each rank's sequence"
          f" length under context_axis; got T_local = {t_local}.")
  checks.one_of("chunk_size", chunk_size, CHUNK_SIZES, optional=True)
  checks.int_at_least("group_width", group_width, 1, optional=True)


def _target(device_kind: str | None = None) -> backends.Target:
  return backends.target(device_kind, off_tpu_mode=mosaic.off_tpu_mode())


def resolve(backend: str, call: common.Call):
  """The backend module that runs `call`: the one decision, logged once.

  `backend` (a name, an alias or "auto") goes through `BACKENDS` (explicit:
  itself; "auto": the first of the platform's preference that takes the
  call), then the op's decode rule: a decode piece (`Call.decode`) shorter
  than a chunk (`backends.chunk_size()`: 16 on CPU, 64 elsewhere) runs the
  token recurrence, "reference" (one state update a token instead of a
  padded chunk; recurrentgemma runs its T == 1 step the same way), and one
  the backend hands on (its `decode_fallback`) runs there. Both are logged
  once; the numbers are the same to float32 rounding. Then the backend must
  take the call (`NotImplementedError` with its reason otherwise).
  """
  name = BACKENDS.choose(backend, call.target, call)
  t = call.q.shape[1]
  if call.decode and name != reference.NAME:
    fallback = getattr(BACKENDS.backends[name], "decode_fallback",
                       lambda _: None)(call)
    if t < backends.chunk_size():
      fallback = reference.NAME
    if fallback is not None:
      backends.log_once(
          ("KDA decode", name, t), "KDA decode piece of T=%d: backend %r"
          " instead of %r (%s).", t, fallback, name,
          "the token recurrence: shorter than a chunk"
          if fallback == reference.NAME else "its decode fallback")
      name = fallback
  return BACKENDS.require(name, call)


def resolved_backend(backend: str = "auto", *,
                     device_kind: str | None = None) -> str:
  """The backend `kimi_delta_attention(..., backend=backend)` runs, by name.

  The canonical name ("mosaic" gives "tokamax"); for "auto", the first of
  the platform's preference that runs on the target: this host, the target
  of `mosaic.lowering_mode` in context, or `device_kind` (e.g. "TPU v6
  lite"). What experiments record and report. A call that backend cannot
  take (e.g. T not a multiple of 64 on "tokamax") makes "auto" take the
  next one, and a backend "auto" picks per call only (`pallas` on a TPU
  v5e, in its measured class) is not named here; both are logged when they
  happen.
  """
  return BACKENDS.choose(backend, _target(device_kind))


def supports_target(backend: str, device_kind: str) -> str | None:
  """Why `backend` (not "auto") cannot run on a device of `device_kind`
  (a TPU that `mosaic.lowering_mode` lowers for included), or None."""
  return BACKENDS.supports_target(
      backend, backends.target(device_kind, off_tpu_mode="lowering"))


def traces_under_check_vma(backend: str) -> bool:
  """Whether every backend `backend` may run (for "auto": on any platform,
  since a program may be lowered for another machine) traces inside
  `jax.shard_map` with `check_vma=True` (tokamax's Pallas kernels do not)."""
  return BACKENDS.capability(backend, "CHECK_VMA", True)


def runs_interpreted(backend: str) -> bool:
  """Whether `backend` runs a TPU kernel in Pallas interpret mode here.

  True when it resolves to a backend that needs a TPU ("tokamax") and this
  host is not a TPU: the kernel then runs only inside `mosaic.interpreted()`,
  which the caller sets up (`experiments.training.interpret.interpret_mode`;
  seconds per call, tiny shapes).
  """
  name = resolved_backend(backend)
  return (getattr(BACKENDS.backends[name], "NEEDS_TPU", False)
          and jax.default_backend() != "tpu")
