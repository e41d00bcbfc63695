"""KDA with context_axis inside shard_map vs the single-device op and oracle.

The sequence (T = 64) is split over 2, 4 or 8 ranks; outputs, final states
and every gradient (random cotangents, taken outside shard_map) must equal
the single-device op with the same backend (relative L2 <= 1e-5, float32),
and outputs and final states the float64 NumPy oracle.
"""

import contextlib

from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from experiments.training import interpret
from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda import api as kda_api
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import tokamax_kernel
from tests.kda_oracle import kda_numpy
from tests.parallel import common

AXIS = "context"
N = 3  # max_num_segments of common.packed_segment_ids()


def make_case(gate, *, segments=True, init=True, b=2, h=2, kd=8, vd=16,
              seed=0):
  """Inputs (dict of arrays) and static keyword arguments of the op."""
  rng = np.random.default_rng(seed)
  t = common.T
  normal = lambda *s: rng.normal(size=s).astype(np.float32)
  args = dict(q=normal(b, t, h, kd), k=normal(b, t, h, kd),
              v=normal(b, t, h, vd),
              beta=rng.uniform(0.05, 1.0, (b, t, h)).astype(np.float32))
  kw = dict(use_qk_l2norm=True)
  if gate == "preactivated":
    args["g"] = rng.uniform(-5.0, 0.0, (b, t, h, kd)).astype(np.float32)
  else:
    args["g"] = normal(b, t, h, kd) * 2.0
    args["a_log"] = np.log(rng.uniform(1, 16, h)).astype(np.float32)
    args["dt_bias"] = normal(h * kd) * 0.5
    kw.update(use_gate_in_kernel=True,
              lower_bound=-5.0 if gate == "lower_bound" else None)
  if segments:
    args["segment_ids"] = common.packed_segment_ids()[:b]
    kw["max_num_segments"] = N
  if init:
    shape = (b,) + ((N,) if segments else ()) + (h, kd, vd)
    args["initial_state"] = normal(*shape) * 0.5
  return {n: jnp.asarray(x) for n, x in args.items()}, kw


def run_op(args, kw, backend, num_ranks, final):
  """The op on one device (num_ranks=None) or sharded over T (`shard_map`
  checks vma types where the backend traces under them)."""
  names = sorted(args)

  def op(*xs):
    a = dict(zip(names, xs))
    return ops.kimi_delta_attention(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a_log=a.get("a_log"),
        dt_bias=a.get("dt_bias"), initial_state=a.get("initial_state"),
        segment_ids=a.get("segment_ids"), output_final_state=final,
        backend=backend, context_axis=None if num_ranks is None else AXIS,
        **kw)

  if num_ranks is None:
    return op(*[args[n] for n in names])
  seq = ("q", "k", "v", "g", "beta", "segment_ids")
  specs = tuple(P(None, AXIS) if n in seq else P() for n in names)
  sharded = jax.shard_map(
      op, mesh=common.mesh(num_ranks), in_specs=specs,
      out_specs=(P(None, AXIS), P()),
      check_vma=kda_api.traces_under_check_vma(backend))
  return sharded(*[args[n] for n in names])


def outputs_and_grads(args, kw, backend, num_ranks, final=True):
  """(o, final state, grads) of sum(o * do) + sum(state * dstate)."""
  diff = [n for n in sorted(args) if n != "segment_ids"]
  o, s = run_op(args, kw, backend, None, final)  # cotangent shapes
  rng = np.random.default_rng(7)
  do = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
  ds = None if s is None else jnp.asarray(rng.normal(size=s.shape),
                                          jnp.float32)

  def loss(xs):
    o, s = run_op(dict(args, **xs), kw, backend, num_ranks, final)
    total = jnp.sum(o * do)
    return total if s is None else total + jnp.sum(s * ds), (o, s)

  grads, (o, s) = jax.jit(jax.grad(loss, has_aux=True))(
      {n: args[n] for n in diff})
  return o, s, grads


def assert_same(actual, expected, rtol=1e-5):
  o, s, g = actual
  o_ref, s_ref, g_ref = expected
  testing.assert_close(o, o_ref, rtol=rtol, name="output")
  if s_ref is not None:
    testing.assert_close(s, s_ref, rtol=rtol, name="final_state")
  for name in g_ref:
    testing.assert_close(g[name], g_ref[name], rtol=rtol, name=f"d{name}")


class ContextParallelKdaTest(parameterized.TestCase):

  # The state passing is backend-agnostic (the op is its per-rank engine):
  # most cases use "reference", the cheapest to compile; "chunked" runs the
  # layer's 8-rank case (all-padding shards) here, and 2 and 4 ranks with
  # initial and final states in the oracle test.
  @parameterized.named_parameters(
      ("reference_cp2_lower_bound", "reference", 2, "lower_bound", True,
       True),
      ("reference_cp4_no_segments", "reference", 4, "preactivated", False,
       True),
      ("reference_cp8_softplus", "reference", 8, "softplus", True, True),
      # The layer's call: no states in or out (ids relabelled by run parity).
      ("reference_cp8_stateless", "reference", 8, "lower_bound", True,
       False),
      ("chunked_cp8_stateless", "chunked", 8, "lower_bound", True, False),
  )
  def test_matches_single_device(self, backend, num_ranks, gate, segments,
                                 stateful):
    args, kw = make_case(gate, segments=segments, init=stateful)
    expected = outputs_and_grads(args, kw, backend, None, final=stateful)
    actual = outputs_and_grads(args, kw, backend, num_ranks, final=stateful)
    assert_same(actual, expected)

  def test_pallas_kernels_as_the_per_rank_engine(self):
    # Backend "pallas" (Pallas interpret mode) under a context axis: its
    # per-rank calls are packed segments with per-segment states (values
    # [v | 0_K] and an identity state in the first), so the kernels run
    # them; outputs, final states and every gradient against the
    # single-device reference op, at 2 ranks with packed segments and
    # initial states, K = V = 128.
    # On a TPU the compiled kernels run (`testing.pallas_interpret`: the
    # interpreter there runs at the chip's default precision).
    args, kw = make_case("lower_bound", h=1, kd=128, vd=128)
    expected = outputs_and_grads(args, kw, "reference", None)
    with (mosaic.interpreted() if testing.pallas_interpret()
          else contextlib.nullcontext()):
      actual = outputs_and_grads(args, dict(kw, precision="highest"),
                                 "pallas", 2)
    assert_same(actual, expected)

  @parameterized.named_parameters(
      ("chunked_cp2", "chunked", 2, "softplus"),
      ("chunked_cp4", "chunked", 4, "lower_bound"),
      ("reference_cp8", "reference", 8, "softplus"),
  )
  def test_matches_float64_oracle(self, backend, num_ranks, gate):
    args, kw = make_case(gate)
    o, s = jax.jit(lambda a: run_op(a, kw, backend, num_ranks, True))(args)
    o_np, s_np = kda_numpy(**args, **kw)
    testing.assert_close(o, o_np, rtol=1e-5, name="output")
    testing.assert_close(s, s_np, rtol=1e-5, name="final_state")

  def test_bad_context_axis(self):
    args, kw = make_case("preactivated", segments=False, init=False)
    call = lambda axis: ops.kimi_delta_attention(
        args["q"], args["k"], args["v"], args["g"], args["beta"],
        context_axis=axis, **kw)
    with self.assertRaisesRegex(ValueError, "context_axis must be None or"):
      call(3)
    with self.assertRaisesRegex(ValueError, "not a bound mesh axis"):
      call(AXIS)  # outside shard_map
    spec = P(None, AXIS)
    inside = jax.shard_map(
        lambda *xs: ops.kimi_delta_attention(*xs, context_axis="seq", **kw),
        mesh=common.mesh(2), in_specs=(spec,) * 5, out_specs=(spec, P()))
    with self.assertRaisesRegex(ValueError, "'seq' is not a bound mesh"):
      inside(args["q"], args["k"], args["v"], args["g"], args["beta"])


class MosaicContextParallelTest(parameterized.TestCase):
  """tokamax's CP path (ContextParallelMetadata) and its limits."""

  # Runs of (id, length) over T = 128, split at 64 over 2 ranks.
  LAYOUTS = {
      # canonical: a document crossing the split, trailing padding
      "packed": ((1, 40), (2, 70), (0, 18)),
      # padding inside a run, a run continuing across the split through
      # padding, ids out of order, id 1 back after id 3 (a new run)
      "any_layout": ((2, 20), (0, 10), (2, 20), (1, 10), (0, 8), (1, 12),
                     (3, 20), (1, 28)),
      "unpacked": None,  # no segment_ids: the adapter hands a row of ones
  }

  @parameterized.parameters("packed", "any_layout", "unpacked")
  @pytest.mark.slow
  def test_interpret_mode_matches_reference(self, layout):
    # tokamax's kernel in Pallas interpret mode (about a minute): 2 ranks,
    # K = V = 128.
    if jax.default_backend() == "tpu":
      # As in tests/ops/test_kda.py: the interpreter's ops would run on the
      # chip at its default precision (2.0e-3..2.4e-3 on a v5e there), and a
      # v5e refuses the compiled kernel (tokamax_kernel.V5E_MEASURED).
      self.skipTest("Pallas interpret mode is the kernel's check off TPU;"
                    " on a TPU the interpreter runs at the chip's arithmetic")
    rng = np.random.default_rng(0)
    b, t, h, kd = 1, 128, 1, 128
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    x = dict(q=normal(b, t, h, kd), k=normal(b, t, h, kd),
             v=normal(b, t, h, kd), g=normal(b, t, h, kd),
             beta=jax.nn.sigmoid(normal(b, t, h)))
    runs = self.LAYOUTS[layout]
    ids = None if runs is None else jnp.asarray(
        np.repeat(*zip(*runs))[None], jnp.int32)
    kw = dict(a_log=jnp.zeros((h,)), dt_bias=normal(h * kd) * 0.1,
              lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm=True,
              max_num_segments=None if runs is None else 4)
    do = normal(b, t, h, kd)
    spec = P(None, AXIS)

    def loss(x, backend, axis):
      op = lambda q, k, v, g, beta, ids: ops.kimi_delta_attention(
          q, k, v, g, beta, segment_ids=ids, backend=backend,
          context_axis=axis, **kw)[0]
      if axis is not None:
        op = jax.shard_map(op, mesh=common.mesh(2), in_specs=(spec,) * 6,
                           out_specs=spec, check_vma=False)
      o = op(x["q"], x["k"], x["v"], x["g"], x["beta"], ids)
      return jnp.sum(o * do), o

    with interpret.interpret_mode():
      grads, o = jax.grad(loss, has_aux=True)(x, "mosaic", AXIS)
    grads_ref, o_ref = jax.jit(jax.grad(loss, has_aux=True),
                               static_argnums=(1, 2))(x, "reference", None)
    # Measured: output 1.6e-6, gradients <= 3.5e-6 (the kernel's own
    # parity with the recurrence, see tests/ops/test_kda.py, is ~1e-6).
    testing.assert_close(o, o_ref, rtol=1e-5, name="output")
    for name in grads_ref:
      testing.assert_close(grads[name], grads_ref[name], rtol=1e-5,
                           name=f"d{name}")

  @parameterized.parameters(2, 4, 8)
  def test_global_runs_label_the_ops_runs_across_ranks(self, num_ranks):
    # Every layout of the op (a run continues through padding; an id back
    # after another is a new run) against the run count on the whole row.
    ids = common.packed_segment_ids()
    want = np.zeros_like(ids)
    for r, row in enumerate(ids):
      previous, n = 0, 0
      for i, x in enumerate(row):
        if x and x != previous:
          n += 1
        previous = x or previous
        want[r, i] = max(n, 1)
    got = jax.shard_map(
        lambda s: tokamax_kernel._global_runs(s, AXIS), mesh=common.mesh(num_ranks),
        in_specs=P(None, AXIS), out_specs=P(None, AXIS))(jnp.asarray(ids))
    # exact: integer labels from integer ids (no floating point).
    np.testing.assert_array_equal(got, want)

  @parameterized.named_parameters(
      ("small_dims", dict(init=False), False, "multiples of 128"),
      ("initial_state", dict(kd=128, vd=128, h=1, b=1), False,
       "initial_state is not supported"),
      ("final_state", dict(kd=128, vd=128, h=1, b=1, init=False), True,
       "output_final_state=True is not supported"),
  )
  def test_limit_raises(self, case_kw, final, message):
    args, kw = make_case("lower_bound", **case_kw)
    with self.assertRaisesRegex(NotImplementedError, message):
      run_op(args, kw, "mosaic", 2, final)
