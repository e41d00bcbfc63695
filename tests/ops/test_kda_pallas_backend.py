"""Backend "pallas" (our Pallas TPU kernels) through the public op.

Compiled on a TPU, in Pallas interpret mode elsewhere
(`mosaic.interpreted()`), against the `reference` backend in float64
(itself anchored by float64 finite differences): outputs, final states and
every gradient (a_log and dt_bias included) under random cotangents, with
grouped value heads, T not a multiple of the chunk, an initial state and
beta in [0, 2]; packed segments as training uses them (no states) and with
per-segment states (more runs than segments: through `chunked`); each
limit the backend names (`NotImplementedError` with its reason; "auto"
passes over it); the op exported for a TPU v5e with `backend="pallas"` (two
Mosaic kernels in its gradient); and where "auto" picks it (the measured
class).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from linear_attention.ops import backends
from linear_attention.ops.kda import api
from linear_attention.ops.kda import common
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import precision as precision_lib
from tests.ops.test_kda import Case, GRAD_ARGS, loss_and_grads, make_inputs
from tests.ops.test_kda_pallas_batched import F32_OP_BOUNDS, pallas_grids

RTOL_F32 = 1e-5
ON_TPU = not testing.pallas_interpret()  # the compiled kernels run


def kernels():
  """The kernels compiled on a TPU, interpreted anywhere else."""
  return contextlib.nullcontext() if ON_TPU else mosaic.interpreted()


def _float64(args):
  """The inputs in float64 on the host's CPU (a TPU has no float64)."""
  cpu = jax.devices("cpu")[0]
  return {n: jax.device_put(np.asarray(x, np.float64), cpu)
          for n, x in args.items()}


# The op's float32 bounds against the float64 recurrence: what float32 at
# precision "auto" (HIGH on every group here, `pallas.FLOAT32_AUTO`) must
# keep; at "highest" every value is held to RTOL_F32.
AUTO_BOUNDS = {n[1:] if n.startswith("d") else n: b
               for n, b in F32_OP_BOUNDS.items() if n != "ds0"}
AUTO_BOUNDS["initial_state"] = F32_OP_BOUNDS["ds0"]


@pytest.mark.parametrize("case, precision", [
    # padded to 128, an initial state
    (Case(b=1, t=100, h=2, k=128, v=128), "highest"),
    (Case(b=2, t=64, h=1, hv=2, k=128, v=128, beta_max=2.0, init=False),
     "highest"),
    (Case(b=1, t=100, h=2, k=128, v=128), "auto"),
])
def test_matches_the_float64_reference(case, precision):
  # Measured in interpret mode (the first case): "highest" 4.6e-7 on the
  # output, 4.5e-7 at most on the gradients; "auto" 6.1e-6 on the output,
  # 6.3e-6 at most on the gradients.
  args, kw = make_inputs(case)
  with kernels():
    o, s, grads = loss_and_grads(args, dict(kw, precision=precision),
                                 "pallas")
  with testing.float64_on_host():
    o64, s64, grads64 = loss_and_grads(_float64(args), kw, "reference")
  rtol = (lambda name: RTOL_F32) if precision == "highest" else (
      lambda name: AUTO_BOUNDS[name])
  testing.assert_close(o, o64, rtol=rtol("output"), name="output")
  testing.assert_close(s, s64, rtol=rtol("final_state"), name="final_state")
  for name in grads64:
    testing.assert_close(grads[name], grads64[name], rtol=rtol(name),
                         name=f"d{name}")


def test_float32_at_auto_runs_three_passes():
  # float32 at "auto": HIGH on every group (the bounds above); bfloat16 at
  # "auto" one pass; a name given is the op's rule.
  pallas = api.BACKENDS.backends["pallas"]
  high, one = (precision_lib.Precisions.every(p) for p in (
      precision_lib.Precision.HIGH, precision_lib.Precision.DEFAULT))
  assert pallas.precisions(_call(dtype="float32")) == high
  assert pallas.precisions(_call()) == one
  assert pallas.precisions(_call(dtype="float32", precision="highest")) == (
      precision_lib.ACCURATE)


def test_packed_segments_match_the_float64_reference():
  # Training's form (no initial state, no final state): runs starting inside
  # chunks and on a chunk edge, trailing padding, grouped value heads, T not
  # a multiple of the chunk; the output and every gradient.
  args, kw = make_inputs(Case(b=2, t=100, h=1, hv=2, k=128, v=128,
                              segments=True, init=False))
  do = np.random.default_rng(1).normal(size=args["v"].shape)

  def output(out):
    assert out[1] is None  # no final state asked
    return out[0]

  (o, o64), grads = _against_float64(args, kw, output, do)
  testing.assert_close(o, o64, rtol=RTOL_F32, name="output")
  for name, x, w in grads:
    testing.assert_close(x, w, rtol=RTOL_F32, name=f"d{name}")


def _against_float64(args, kw, pick, cotangent):
  """((value, value64), [(name, grad, grad64)]): `pick` of the op's
  outputs and the gradients of sum(pick(...) * cotangent) through the
  kernels ("pallas" at HIGHEST) and through the float64 reference op."""
  names = [n for n in GRAD_ARGS if n in args]

  def run(args, backend, **more):
    def loss(*diff):
      out = pick(ops.kimi_delta_attention(
          **dict(args, **dict(zip(names, diff))), backend=backend, **kw,
          **more))
      return jnp.sum(out * jnp.asarray(cotangent, out.dtype)), out
    return jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
        *[args[n] for n in names])

  with kernels():
    g, value = run(args, "pallas", precision="highest")
  with testing.float64_on_host():
    g64, value64 = run(_float64(args), "reference")
  return (value, value64), list(zip(names, g, g64))


@pytest.mark.parametrize("over", [False, True])
def test_per_segment_states_match_the_float64_reference(over):
  # Initial states per segment in, final states per segment out, every
  # gradient; `over`: a row holds a segment met again after another, so
  # more runs than max_num_segments (4) and the call runs on `chunked`
  # (chosen on the device, `jax.lax.cond`), with the same answer.
  args, kw = make_inputs(Case(b=2, t=100, h=1, hv=2, k=128, v=128,
                              segments=True))
  if over:  # row 1: segments 1, 2, 1, 2, 1
    ids = np.array(kw["segment_ids"])
    ids[1, :95] = np.repeat([1, 2, 1, 2, 1], 19)
    kw["segment_ids"] = jnp.asarray(ids)
  with kernels():
    o, s, grads = loss_and_grads(args, dict(kw, precision="highest"),
                                 "pallas")
  with testing.float64_on_host():
    o64, s64, grads64 = loss_and_grads(_float64(args), kw, "reference")
  testing.assert_close(o, o64, rtol=RTOL_F32, name="output")
  testing.assert_close(s, s64, rtol=RTOL_F32, name="final_state")
  for name in grads64:
    testing.assert_close(grads[name], grads64[name], rtol=RTOL_F32,
                         name=f"d{name}")


def test_chunk_boundary_states_match_the_float64_reference():
  # `output_chunk_states` through `context_parallel.chunk_states`: pieces of
  # 32 tokens as rows of one call with per-segment states (packed segments
  # and initial states here), composed by a scan; the states and their
  # gradients against the float64 reference op.
  args, kw = make_inputs(Case(b=2, t=100, h=1, k=128, v=128, segments=True))
  kw = dict(kw, output_final_state=True, output_chunk_states=True,
            chunk_states_every=32)
  dc = np.random.default_rng(2).normal(size=(2, 3, 1, 128, 128))
  (c, c64), grads = _against_float64(args, kw, lambda out: out[2], dc)
  testing.assert_close(c, c64, rtol=RTOL_F32, name="chunk states")
  for name, x, w in grads:
    testing.assert_close(x, w, rtol=RTOL_F32, name=f"d{name}")


@pytest.mark.parametrize("segments", [False, True])
def test_chunk_boundary_states_in_one_pass_match_the_float64_reference(
    segments):
  # `pallas.one_pass_chunk_states`: C a multiple of the kernel's chunk and
  # no per-segment states, so the kernels write the state every C = 64
  # tokens in their one pass (one forward pallas_call, not the pieces'
  # two). T = 200 (a tail after the last boundary), grouped value heads;
  # without segments an initial state and the final state, with packed
  # segments (training's form) a boundary on padding (zeros there). The
  # states and every gradient against the float64 reference op; measured
  # in interpret mode: states 9.5e-8, gradients 1.7e-7..3.3e-6, and
  # d initial_state 5.6e-6 (it reaches the states through 64 tokens of
  # decay, whose float32 exponent keeps |sum g| 2^-24 of it).
  args, kw = make_inputs(Case(b=2, t=200, h=1, hv=2, k=128, v=128,
                              segments=segments, init=not segments))
  if segments:  # row 1's second boundary (token 127) on padding
    ids = np.array(kw["segment_ids"])
    ids[1, 120:130] = 0
    kw["segment_ids"] = jnp.asarray(ids)
  kw = dict(kw, output_final_state=not segments, output_chunk_states=True,
            chunk_states_every=64)
  dc = np.random.default_rng(2).normal(size=(2, 3, 2, 128, 128))
  (c, c64), grads = _against_float64(args, kw, lambda out: out[2], dc)
  testing.assert_close(c, c64, rtol=RTOL_F32, name="chunk states")
  for name, x, w in grads:
    if name != "q":  # the states do not depend on q (a zero gradient)
      testing.assert_close(x, w, rtol=RTOL_F32, name=f"d{name}")
  if segments:
    np.testing.assert_array_equal(np.asarray(c)[1, 1], 0.0)
  with kernels():
    forward = jax.make_jaxpr(lambda a: ops.kimi_delta_attention(
        **a, backend="pallas", **kw))(args)
  assert len(pallas_grids(forward.jaxpr)) == 1


@pytest.mark.parametrize("t", [4096, 512])
def test_one_pass_chunk_states_export_for_tpu_v5e(t):
  # The state after every 1024 (256) tokens, strided at T 4096 and 16 heads
  # a step at T 512: the forward one Mosaic kernel, its gradient two.
  args, kw = make_inputs(Case(b=1, t=t, h=16, k=128, v=128,
                              dtype="bfloat16"))
  kw = dict(kw, output_chunk_states=True, chunk_states_every=t // 4,
            backend="pallas")
  specs = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in args.items()}
  states = lambda a: ops.kimi_delta_attention(**a, **kw)[2]
  loss = lambda a: jnp.sum(states(a))
  with mosaic.lowering_mode("v5e"):
    forward = jax.export.export(jax.jit(states), platforms=["tpu"])(specs)
    grads = jax.export.export(jax.jit(jax.grad(loss)),
                              platforms=["tpu"])(specs)
  assert forward.mlir_module().count("tpu_custom_call") == 1
  assert forward.out_avals[0].shape == (1, 4, 16, 128, 128)
  assert grads.mlir_module().count("tpu_custom_call") == 2


@pytest.mark.parametrize("case, kw, reason", [
    (Case(t=64, k=128, v=128, gate="softplus"), {}, "lower-bound gate"),
    (Case(t=64, k=128, v=128, gate="preactivated"), {}, "lower-bound gate"),
    (Case(t=64, k=64, v=128), {}, "multiples of 128"),
])
def test_limits_name_themselves(case, kw, reason):
  args, base = make_inputs(case)
  call = lambda backend: ops.kimi_delta_attention(
      **args, backend=backend, **base, **kw)
  with kernels():
    with pytest.raises(NotImplementedError, match=reason):
      call("pallas")
    call("auto")  # "auto" passes over it (here: to chunked)


@pytest.mark.skipif(ON_TPU, reason="the check is for hosts without a TPU")
def test_needs_a_tpu_outside_interpret_mode():
  args, kw = make_inputs(Case(t=64, k=128, v=128))
  with pytest.raises(NotImplementedError, match="needs a TPU"):
    ops.kimi_delta_attention(**args, backend="pallas", **kw)
  assert api.resolved_backend("auto") == "chunked"


def test_op_exports_for_tpu_v5e():
  args, kw = make_inputs(Case(b=1, t=128, h=16, k=128, v=128,
                              dtype="bfloat16"))
  names = [n for n in GRAD_ARGS if n in args]
  specs = [jax.ShapeDtypeStruct(args[n].shape, args[n].dtype) for n in names]

  def loss(*xs):
    full = dict(args, **dict(zip(names, xs)))
    o, s = ops.kimi_delta_attention(**full, output_final_state=True,
                                    backend="pallas", **kw)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  with mosaic.lowering_mode("v5e"):
    exported = jax.export.export(
        jax.jit(jax.grad(loss, argnums=tuple(range(len(names))))),
        platforms=["tpu"])(*specs)
  assert exported.mlir_module().count("tpu_custom_call") == 2


def _call(kind="TPU v5 lite", dtype="bfloat16", t=4096, h=16, kd=128,
          precision="auto", **changes):
  """An abstract call of the op (shapes and dtypes only) for a target."""
  x = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
  fields = dict(
      q=x(1, t, h, kd), k=x(1, t, h, kd), v=x(1, t, h, kd),
      g=x(1, t, h, kd, dt="float32"), beta=x(1, t, h, dt="float32"),
      scale=kd ** -0.5, a_log=x(h, dt="float32"),
      dt_bias=x(h * kd, dt="float32"), lower_bound=-5.0,
      use_gate_in_kernel=True, use_qk_l2norm=True, initial_state=None,
      output_final_state=False, segment_ids=None, max_num_segments=None,
      output_chunk_states=False, chunk_states_every=1, context_axis=None,
      chunk_size=None, group_width=None, precision=precision,
      target=backends.target(kind, off_tpu_mode="lowering"))
  return common.Call(**dict(fields, **changes))


_IDS = jax.ShapeDtypeStruct((1, 4096), jnp.int32)


@pytest.mark.parametrize("call, expected", [
    # The class measured faster than every other backend on a v5e.
    (_call(), "pallas"),
    (_call(t=8192, h=32), "pallas"),
    (_call(t=1024, h=32), "pallas"),
    (_call(t=512, h=32), "pallas"),
    (_call(t=8192, h=32, segment_ids=jax.ShapeDtypeStruct((1, 8192),
                                                          jnp.int32)),
     "pallas"),
    (_call(segment_ids=_IDS, max_num_segments=8, output_final_state=True),
     "pallas"),
    (_call(t=256, h=32), "pallas"),
    (_call(t=128, h=32), "pallas"),
    (_call(t=128), "pallas"),
    (_call(t=8192, h=32, output_chunk_states=True, chunk_states_every=1024),
     "pallas"),
    (_call(output_chunk_states=True, chunk_states_every=2048), "pallas"),
    (_call(dtype="float32", h=32), "pallas"),
    (_call(dtype="float32", h=8, t=1024), "pallas"),
    (_call(dtype="float32", h=32, t=512), "pallas"),
    (_call(dtype="float32", h=32, t=256), "pallas"),
    (_call(dtype="float32", segment_ids=_IDS), "pallas"),
    (_call(dtype="float32", segment_ids=_IDS, max_num_segments=8,
           output_final_state=True), "pallas"),
    # Outside it on a v5e: tokamax's kernel refuses the v5e, so chunked.
    (_call(t=127, h=32), "chunked"),
    (_call(t=64), "chunked"),
    (_call(h=8), "chunked"),
    (_call(dtype="float32", t=255, h=32), "chunked"),
    (_call(dtype="float32", h=4), "chunked"),
    # Per-segment states whose layout would add more than T / 8 tokens.
    (_call(segment_ids=_IDS, max_num_segments=9, output_final_state=True),
     "chunked"),
    (_call(dtype="float32", segment_ids=_IDS, max_num_segments=9,
           output_final_state=True), "chunked"),
    (_call(precision="highest"), "chunked"),
    (_call(dtype="float32", precision="highest"), "chunked"),
    (_call(lower_bound=None, use_gate_in_kernel=False), "chunked"),
    (_call(chunk_size=32), "chunked"),
    (_call(use_qk_l2norm=False), "chunked"),
    # Chunk-boundary states closer than timed, or in float32 (untimed).
    (_call(output_chunk_states=True), "chunked"),
    (_call(output_chunk_states=True, chunk_states_every=512), "chunked"),
    (_call(dtype="float32", output_chunk_states=True,
           chunk_states_every=1024), "chunked"),
    # Not timed on other chips: the v6e keeps tokamax's kernel.
    (_call(kind="TPU v6 lite"), "tokamax"),
])
def test_auto_picks_the_kernels_in_their_measured_class(call, expected):
  assert api.BACKENDS.choose("auto", call.target, call) == expected
  pallas = api.BACKENDS.backends["pallas"]
  passed_over = pallas.supports(call) or pallas.auto_declines(call.target, call)
  assert bool(passed_over) == (expected != "pallas"), passed_over


@pytest.mark.parametrize("call, strided, primal", [
    # Both kernels strided: timed at bfloat16 B1 T8192 H32 and B8 T4096 H16.
    (_call(), True, False),
    (_call(t=8192, h=32), True, False),
    # The strided forward for calls not differentiated: timed at B1 H32
    # T1024 and T2048.
    (_call(t=4095), False, True),
    (_call(t=1024, h=32), False, True),
    (_call(t=1023, h=32), False, False),
    (_call(h=48), False, False),  # all heads a step: untimed above 32
    (_call(h=8), False, False),
    (_call(dtype="float32"), False, False),
    (_call(segment_ids=_IDS), False, False),
    (_call(chunk_size=32), False, False),
    (_call(kd=256), False, False),
])
def test_the_strided_kernels_run_where_timed(call, strided, primal):
  pallas = api.BACKENDS.backends["pallas"]
  assert (pallas.strided(call), pallas.strided_primal(call)) == (
      strided, primal)


@pytest.mark.parametrize("t, forward, backward", [
    (4096, [(1, 64)], [(1, 64), (1, 64)]),  # both kernels strided
    (2048, [(1, 32)], [(2, 32), (2, 32)]),  # the strided forward alone
    (512, [(2, 8)], [(2, 8), (2, 8)]),  # 16 heads a step throughout
])
def test_the_op_runs_the_strided_kernels_by_the_class(t, forward, backward):
  # Through the op on backend "pallas": the pallas_calls' grids, forward
  # and under a gradient (rows: one for all 32 heads a step, two for 16).
  x = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  q = x(1, t, 32, 128)
  kw = dict(a_log=jnp.zeros(32), dt_bias=jnp.zeros(32 * 128),
            lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
            backend="pallas")
  run = lambda q: ops.kimi_delta_attention(q, q, q, q, q[..., 0], **kw)[0]
  loss = lambda q: jnp.sum(run(q).astype(jnp.float32))
  with kernels():
    assert pallas_grids(jax.make_jaxpr(run)(q).jaxpr) == forward
    assert pallas_grids(jax.make_jaxpr(jax.grad(loss))(q).jaxpr) == backward


def test_float32_auto_packed_segments_and_their_states_keep_the_op_bounds():
  # The float32 class at "auto" (HIGH, `pallas.FLOAT32_AUTO`) with packed
  # segments and per-segment states: the output, final states and every
  # gradient within the op's float32 bounds of the float64 reference.
  # Measured in interpret mode: output 5.6e-6, final states 1.2e-6, the
  # gradients 6.7e-8..6.2e-6.
  args, kw = make_inputs(Case(b=2, t=100, h=1, hv=2, k=128, v=128,
                              segments=True))
  with kernels():
    o, s, grads = loss_and_grads(args, dict(kw, precision="auto"), "pallas")
  with testing.float64_on_host():
    o64, s64, grads64 = loss_and_grads(_float64(args), kw, "reference")
  testing.assert_close(o, o64, rtol=AUTO_BOUNDS["output"], name="output")
  testing.assert_close(s, s64, rtol=AUTO_BOUNDS["final_state"],
                       name="final_state")
  for name in grads64:
    testing.assert_close(grads[name], grads64[name], rtol=AUTO_BOUNDS[name],
                         name=f"d{name}")


def test_auto_runs_the_kernels_in_a_program_exported_for_a_v5e():
  def forward(dtype):
    args, kw = make_inputs(Case(b=1, t=4096, h=16, k=128, v=128,
                                dtype=dtype))
    specs = {n: jax.ShapeDtypeStruct(x.shape, x.dtype)
             for n, x in args.items()}
    f = lambda a: ops.kimi_delta_attention(**a, backend="auto", **kw)[0]
    with mosaic.lowering_mode("v5e"):
      return jax.export.export(jax.jit(f), platforms=["tpu"])(specs)

  assert forward("bfloat16").mlir_module().count("tpu_custom_call") == 1
  assert forward("float32").mlir_module().count("tpu_custom_call") == 1
