"""Gradients anchored to float64 finite differences, outside the library.

Under `jax.enable_x64(True)` the XLA backends (`reference`, `chunked`) and
the short convolution compute, accumulate and return states in float64 for
float64 inputs (`ops/kda/common.compute_dtype`). That makes a plain central
difference an independent judge of every reverse-mode gradient: for each
argument x and a random direction u,

    <dL/dx, u>   vs   (L(x + eps u) - L(x - eps u)) / (2 eps),

with L = sum(o * do) + sum(final_state * ds) under random cotangents. In
float64 with eps = 1e-6 the difference quotient is exact to ~1e-9 relative,
so the tolerance (1e-7) leaves no room for a wrong gradient. `reference` is
anchored this way; `chunked` (both chunk sizes) and the context-parallel
path too, and `chunked` also matches `reference` entry by entry in float64.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from tests.kda_oracle import kda_numpy
from tests.parallel import test_kda_cp as cp_tests

EPS = 1e-6
RTOL = 1e-7  # directional derivative vs central difference, float64
DIFF = ("q", "k", "v", "g", "beta", "a_log", "dt_bias", "initial_state")


@pytest.fixture(autouse=True)
def x64():
  # Every test here is float64: on the host's CPU on any host (on a TPU
  # float64 is emulated, minutes a test; `testing.float64_on_host`).
  with testing.float64_on_host():
    yield


def make_case(gate, *, segments, init, b=3, t=40, h=2, kd=8, vd=6, seed=0,
              value_heads=None, neg_eigval=False):
  """float64 inputs; with segments: interior and trailing padding, an
  all-padding row, a reappearing id, and runs that cross chunk edges.
  value_heads: HV > h for grouped value heads; neg_eigval: beta in [0, 2]."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.normal(size=s)
  hq, h = h, value_heads or h  # from here on h counts the value heads
  args = dict(q=normal(b, t, hq, kd), k=normal(b, t, hq, kd),
              v=normal(b, t, h, vd),
              beta=rng.uniform(0.05, 1.95 if neg_eigval else 1.0, (b, t, h)))
  kw = dict(use_qk_l2norm=True)
  if neg_eigval:
    kw.update(allow_neg_eigval=True)
  if gate == "preactivated":
    args["g"] = rng.uniform(-5.0, 0.0, (b, t, h, kd))
  else:
    args["g"] = normal(b, t, h, kd) * 2.0
    args["a_log"] = np.log(rng.uniform(1, 16, h))
    args["dt_bias"] = normal(h * kd) * 0.5
    kw.update(use_gate_in_kernel=True,
              lower_bound=-5.0 if gate == "lower_bound" else None)
  n = 3
  if segments:
    seg = np.zeros((b, t), np.int32)
    seg[0, :15], seg[0, 18:36] = 1, 2  # padding inside, and after
    seg[1, :10], seg[1, 10:24], seg[1, 24:37] = 3, 1, 3  # id 3 reappears
    # row 2 is padding only; both other rows end in padding
    kw.update(segment_ids=jnp.asarray(seg), max_num_segments=n)
  if init:
    shape = (b,) + ((n,) if segments else ()) + (h, kd, vd)
    args["initial_state"] = normal(*shape) * 0.5
  return {name: jnp.asarray(x, jnp.float64) for name, x in args.items()}, kw


def kda_loss(kw, backend, shapes, seed=1, context=None):
  """L(args) = sum(o * do) + sum(state * ds), random fixed cotangents."""
  rng = np.random.default_rng(seed)
  do = jnp.asarray(rng.normal(size=shapes[0]))
  ds = jnp.asarray(rng.normal(size=shapes[1]))

  def loss(args):
    if context is not None:
      o, s = context(args)
    else:
      o, s = ops.kimi_delta_attention(
          args["q"], args["k"], args["v"], args["g"], args["beta"],
          a_log=args.get("a_log"), dt_bias=args.get("dt_bias"),
          initial_state=args.get("initial_state"), output_final_state=True,
          backend=backend, **kw)
    return jnp.sum(o * do) + jnp.sum(s * ds)

  return loss


def check_against_finite_differences(loss, args, names, seed=2):
  """Every named argument's gradient, along a random direction."""
  loss_j = jax.jit(loss)
  grads = jax.jit(jax.grad(loss))(args)
  rng = np.random.default_rng(seed)
  for name in names:
    u = jnp.asarray(rng.normal(size=args[name].shape))
    plus = loss_j(dict(args, **{name: args[name] + EPS * u}))
    minus = loss_j(dict(args, **{name: args[name] - EPS * u}))
    numeric = float(plus - minus) / (2 * EPS)
    analytic = float(jnp.vdot(grads[name], u))
    assert abs(analytic - numeric) <= RTOL * max(1.0, abs(numeric)), (
        f"d{name}: autodiff {analytic!r} vs finite difference {numeric!r}")
  return grads


CASES = {
    "lower_bound": dict(gate="lower_bound", segments=False, init=True),
    "softplus_segments_padding": dict(gate="softplus", segments=True,
                                      init=True),
    "preactivated_segments_no_init": dict(gate="preactivated", segments=True,
                                          init=False),
    # grouped value heads (HV = 2 H) and beta in [0, 2], with everything else
    "gva_neg_eigval_segments": dict(gate="softplus", segments=True, init=True,
                                    value_heads=4, neg_eigval=True),
}


def _run(args, kw, backend):
  return jax.jit(lambda a: ops.kimi_delta_attention(
      a["q"], a["k"], a["v"], a["g"], a["beta"], a_log=a.get("a_log"),
      dt_bias=a.get("dt_bias"), initial_state=a.get("initial_state"),
      output_final_state=True, backend=backend, **kw))(args)


# chunk 64 (several 16-token blocks per chunk) costs minutes to compile in
# float64 with segments on a 2-core CPU: it runs the unsegmented case.
@pytest.mark.parametrize("case,backend,chunk", [
    (case, "reference", None) for case in sorted(CASES)] + [
        (case, "chunked", 16) for case in sorted(CASES)] + [
            ("lower_bound", "chunked", 64)])
def test_kda_gradients_match_finite_differences(case, backend, chunk):
  args, kw = make_case(**CASES[case])
  tuned = dict(kw, chunk_size=chunk)  # the op's; the oracle takes kw
  o, s = _run(args, tuned, backend)
  assert o.dtype == jnp.float64 and s.dtype == jnp.float64
  # The float64 forward equals the NumPy recurrence to float64 rounding.
  o_np, s_np = kda_numpy(**args, **kw)
  testing.assert_close(o, o_np, rtol=1e-12, name="output")
  testing.assert_close(s, s_np, rtol=1e-12, name="final_state")
  loss = kda_loss(tuned, backend, (o.shape, s.shape))
  grads = check_against_finite_differences(
      loss, args, [n for n in DIFF if n in args])
  # exact: padding inputs are masked with jnp.where: zero cotangents.
  if "segment_ids" in kw:  # padding tokens get exactly zero gradient
    pad = np.asarray(kw["segment_ids"]) == 0
    for name in ("q", "k", "v", "g", "beta"):
      np.testing.assert_array_equal(np.asarray(grads[name])[pad], 0.0,
                                    err_msg=f"d{name} at padding")
  if backend == "chunked":  # and entry by entry, against reference
    expected = jax.jit(jax.grad(kda_loss(kw, "reference",
                                         (o.shape, s.shape))))(args)
    for name in expected:
      testing.assert_close(grads[name], expected[name], rtol=1e-10,
                           name=f"d{name}")


# The state passing is the same for every backend (each is the per-rank
# engine): the cheapest to compile, reference, takes the 4-rank case.
@pytest.mark.parametrize("backend,num_ranks,gate", [
    ("reference", 4, "lower_bound"),
    # Found a bug: under shard_map's check_vma=True, chunked's custom-VJP
    # matmuls returned a mesh-varying cotangent for a mesh-invariant operand
    # (a constant), and tracing the gradient failed; `linalg._same_vma`.
    pytest.param("chunked", 2, "softplus", marks=pytest.mark.slow)])
def test_context_parallel_gradients_match_finite_differences(
    backend, num_ranks, gate):
  args, kw = cp_tests.make_case(gate)  # packed documents across ranks
  args = {n: (x if n == "segment_ids" else x.astype(jnp.float64))
          for n, x in args.items()}
  ids = args.pop("segment_ids")
  sharded = lambda a: cp_tests.run_op(dict(a, segment_ids=ids), kw, backend,
                                      num_ranks, True)
  o, s = jax.jit(sharded)(args)
  assert o.dtype == jnp.float64 and s.dtype == jnp.float64
  o_np, s_np = kda_numpy(**args, segment_ids=ids, **kw)
  testing.assert_close(o, o_np, rtol=1e-12, name="output")
  testing.assert_close(s, s_np, rtol=1e-12, name="final_state")
  loss = kda_loss(kw, backend, (o.shape, s.shape), context=sharded)
  check_against_finite_differences(loss, args, sorted(args))


@pytest.mark.parametrize("segments", [False, True])
def test_short_conv_gradients_match_finite_differences(segments):
  rng = np.random.default_rng(3)
  b, t, c, width = 2, 23, 5, 4
  args = dict(x=jnp.asarray(rng.normal(size=(b, t, c))),
              w=jnp.asarray(rng.normal(size=(width, c))),
              bias=jnp.asarray(rng.normal(size=(c,))))
  ids = None
  if segments:
    ids = np.ones((b, t), np.int32)
    ids[0, 7:9], ids[0, 9:], ids[1, 20:] = 0, 2, 0
    ids = jnp.asarray(ids)
  y = ops.short_conv1d(args["x"], args["w"], bias=args["bias"],
                       segment_ids=ids)
  assert y.dtype == jnp.float64
  dy = jnp.asarray(rng.normal(size=y.shape))
  loss = lambda a: jnp.sum(ops.short_conv1d(
      a["x"], a["w"], bias=a["bias"], segment_ids=ids) * dy)
  check_against_finite_differences(loss, args, sorted(args))
