"""KDA op: reference vs a float64 NumPy oracle; chunked and mosaic vs reference.

Every comparison is a relative L2 error (see `linear_attention.testing`):
outputs, final states, and every gradient under random cotangents
(`sum(o * do) + sum(state * dstate)`), as in fla's tests/ops/test_kda.py.
"""

import dataclasses

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.training import interpret
from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda import chunked
from linear_attention.ops.kda.chunked import grouped as chunked_grouped
from tests.kda_oracle import kda_numpy

GRAD_ARGS = ("q", "k", "v", "g", "beta", "a_log", "dt_bias", "initial_state")


@dataclasses.dataclass(frozen=True)
class Case:
  b: int = 2
  t: int = 100
  h: int = 2
  k: int = 16
  v: int = 24
  gate: str = "lower_bound"  # "lower_bound" | "softplus" | "preactivated"
  lower_bound: float = -5.0  # for gate="lower_bound"
  g_min: float = -5.0  # for pre-activated log decays: U(g_min, 0)
  segments: bool = False
  init: bool = True
  l2norm: bool = True
  dtype: str = "float32"
  seed: int = 0
  hv: int | None = None  # value heads (grouped value heads); None: h
  beta_max: float = 1.0  # > 1 sets allow_neg_eigval


def make_inputs(c: Case):
  """Random inputs for a case, as a dict of op keyword arguments."""
  rng = np.random.default_rng(c.seed)
  normal = lambda *s: rng.normal(size=s).astype(np.float32)
  hv = c.hv or c.h
  args = dict(q=normal(c.b, c.t, c.h, c.k), k=normal(c.b, c.t, c.h, c.k),
              v=normal(c.b, c.t, hv, c.v),
              beta=rng.uniform(0.05, c.beta_max, (c.b, c.t, hv)).astype(
                  np.float32))
  if not c.l2norm:
    args["k"] = args["k"] / np.linalg.norm(args["k"], axis=-1, keepdims=True)
  kw = dict(use_qk_l2norm=c.l2norm)
  if c.beta_max > 1:
    kw.update(allow_neg_eigval=True)
  c = dataclasses.replace(c, h=hv)  # gates and states follow the value heads
  if c.gate == "preactivated":
    args["g"] = rng.uniform(c.g_min, 0.0, (c.b, c.t, c.h, c.k)).astype(
        np.float32)
  else:
    args["g"] = normal(c.b, c.t, c.h, c.k) * 2.0
    args["a_log"] = np.log(rng.uniform(1, 16, c.h)).astype(np.float32)
    args["dt_bias"] = normal(c.h * c.k) * 0.5
    kw.update(use_gate_in_kernel=True,
              lower_bound=c.lower_bound if c.gate == "lower_bound" else None)
  n = None
  if c.segments:
    n = 4
    seg = np.zeros((c.b, c.t), np.int32)
    for row in range(c.b):  # cut points inside chunks and on a chunk edge
      cuts = sorted(rng.choice(np.arange(1, c.t), size=min(3, c.t - 1),
                               replace=False)) if c.t > 3 else [c.t]
      edges = [0] + list(cuts) + [c.t]
      for i in range(len(edges) - 1):
        seg[row, edges[i]:edges[i + 1]] = i + 1
      seg[row, max(1, c.t - 5 - row):] = 0  # trailing padding
    if c.t >= 64:
      seg[0, :64], seg[0, 64:c.t - 5] = 1, 2  # a boundary on a chunk edge
    kw.update(segment_ids=seg, max_num_segments=n)
  if c.init:
    shape = (c.b,) + ((n,) if c.segments else ()) + (c.h, c.k, c.v)
    args["initial_state"] = normal(*shape) * 0.5
  dtype = jnp.dtype(c.dtype)
  for name in ("q", "k", "v", "g", "beta"):
    args[name] = jnp.asarray(args[name], dtype)
  for name in ("a_log", "dt_bias", "initial_state"):
    if name in args:
      args[name] = jnp.asarray(args[name])
  if "segment_ids" in kw:
    kw["segment_ids"] = jnp.asarray(kw["segment_ids"])
  return args, kw


def loss_and_grads(args, kw, backend, seed=1):
  """Outputs, final state and gradients of a random-cotangent loss."""
  names = [n for n in GRAD_ARGS if n in args]

  def run(*diff):
    full = dict(args, **dict(zip(names, diff)))
    return ops.kimi_delta_attention(
        full["q"], full["k"], full["v"], full["g"], full["beta"],
        a_log=full.get("a_log"), dt_bias=full.get("dt_bias"),
        initial_state=full.get("initial_state"), output_final_state=True,
        backend=backend, **kw)

  o, state = run(*[args[n] for n in names])
  rng = np.random.default_rng(seed)
  do = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
  ds = jnp.asarray(rng.normal(size=state.shape), jnp.float32)

  def loss(*diff):
    o, s = run(*diff)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds)

  grads = jax.grad(loss, argnums=tuple(range(len(names))))(
      *[args[n] for n in names])
  return o, state, dict(zip(names, grads))


def reference_on_host(args, kw, seed=1):
  """`loss_and_grads` of the `reference` backend, run on the host CPU.

  On a TPU the token scan multiplies the state by the chip's exp once a
  token, and that error compounds (2.9e-5 against float64 on a v5e, where
  chunked keeps 3e-6: docs/tpu.md); the host's float32 scan is the check.
  On a CPU host this is the same call as before.
  """
  cpu = jax.devices("cpu")[0]
  host = lambda tree: jax.tree.map(
      lambda x: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x,
      tree)
  kw = host(kw)
  with jax.default_device(cpu):
    return jax.jit(lambda a: loss_and_grads(a, kw, "reference", seed))(
        host(args))


# d a_log on a TPU v5e. It is one sum of B*T*K terms per head, and where the
# terms cancel the sum keeps fewer digits than its terms: in the cases below
# that miss 1e-5 on the chip (their inputs: t100_segments, segments_no_init,
# groups_of_2_padded_bound_2_5), sum|terms| / |sum| is 32-221 per head,
# measured in float64 on a CPU; in t63 and t257, which pass there, 3-4.
# Measured on the v5e (JAX 0.12.0.1, libtpu 0.0.50.1, at e63000f) against
# the host's reference: 1.42e-5..2.31e-5 in five float32 cases, 4.17e-2 with
# bfloat16 inputs; on a CPU the chunked backend keeps <= 5.1e-6 against
# float64 on those three inputs. The output and the state kept the 1e-5 /
# 2e-2 bounds on the chip; the gradients after d a_log were not checked in
# those six cases (the check then stopped at its first miss; it now reports
# every miss).
TPU_DA_LOG_RTOL = {np.dtype("float32"): 3e-5, np.dtype("bfloat16"): 5e-2}


def assert_all_close(actual, expected, rtol):
  """Output, final state and every gradient within rtol; every miss named."""
  o, s, g = actual
  o_ref, s_ref, g_ref = expected
  checks = [("output", o, o_ref, rtol), ("final_state", s, s_ref, rtol)]
  for name in g_ref:
    bound = rtol
    if name == "a_log" and jax.default_backend() == "tpu":
      bound = max(rtol, TPU_DA_LOG_RTOL[np.dtype(o.dtype)])
    checks.append((f"d{name}", g[name], g_ref[name], bound))
  misses = []
  for name, x, want, bound in checks:
    try:
      testing.assert_close(x, want, rtol=bound, name=name)
    except AssertionError as e:
      misses.append(str(e))
  if misses:
    raise AssertionError("; ".join(misses))


class ReferenceVsNumpyTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("lower_bound", Case()),
      ("softplus_t63", Case(t=63, gate="softplus")),
      ("preactivated_segments", Case(gate="preactivated", segments=True)),
      ("segments_no_init_no_l2", Case(segments=True, init=False, l2norm=False)),
      ("t1", Case(t=1, h=3)),
  )
  def test_matches_float64_oracle(self, case):
    args, kw = make_inputs(case)
    o, s = ops.kimi_delta_attention(
        **args, output_final_state=True, backend="reference", **kw)
    o_np, s_np = kda_numpy(**args, **kw)
    testing.assert_close(o, o_np, rtol=1e-5, name="output")
    testing.assert_close(s, s_np, rtol=1e-5, name="final_state")


CHUNKED_CASES = (
    ("t1", Case(t=1)),
    ("t63", Case(t=63)),
    ("t64_h4_softplus", Case(t=64, h=4, gate="softplus")),
    ("t100_segments", Case(t=100, segments=True)),
    ("t257_segments_softplus", Case(t=257, segments=True, gate="softplus",
                                    b=1)),
    ("t257", Case(t=257, b=1, k=32, v=16)),
    ("decay_minus_1000", Case(t=130, gate="preactivated", g_min=-1000.0)),
    ("decay_minus_1000_segments", Case(t=130, gate="preactivated",
                                       g_min=-1000.0, segments=True)),
    ("segments_no_init", Case(t=100, segments=True, init=False)),
    # Bounds above -5 factor larger blocks (chunked.block_size): 32 and 64.
    ("lower_bound_2_5_segments", Case(t=130, segments=True, lower_bound=-2.5)),
    ("lower_bound_1_segments", Case(t=130, segments=True, lower_bound=-1.0,
                                    k=32)),
)
# Every case at both chunk sizes (backends.chunk_size: 16 on CPU, 64 on
# accelerators); only 64-token chunks have several blocks.
CHUNKED_CASES_BY_SIZE = tuple(
    (f"{name}_chunk{size}", case, size)
    for name, case in CHUNKED_CASES for size in (16, 64))


class ChunkedVsReferenceTest(chex.TestCase):

  @chex.variants(with_jit=True)
  @parameterized.named_parameters(*CHUNKED_CASES_BY_SIZE)
  def test_forward_and_gradients(self, case, size):
    args, kw = make_inputs(case)
    # kw holds arrays (segment ids): close over it instead of passing it.
    tuned = dict(kw, chunk_size=size)
    actual = self.variant(lambda a: loss_and_grads(a, tuned, "chunked"))(args)
    expected = reference_on_host(args, kw)
    assert_all_close(actual, expected, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  @pytest.mark.slow
  def test_eager_and_jit_agree_with_reference(self):
    # Op-by-op dispatch is slow: one small packed case covers the eager path.
    case = Case(b=1, t=70, segments=True)
    args, kw = make_inputs(case)
    actual = self.variant(lambda a: loss_and_grads(a, kw, "chunked"))(args)
    expected = reference_on_host(args, kw)
    assert_all_close(actual, expected, rtol=1e-5)

  @parameterized.parameters(True, False)
  def test_bfloat16_inputs(self, segments):
    case = Case(t=100, segments=segments, dtype="bfloat16")
    args, kw = make_inputs(case)
    actual = jax.jit(lambda a: loss_and_grads(a, kw, "chunked"))(args)
    # The oracle runs the same bf16-rounded inputs in float32.
    ref_args = {n: x.astype(jnp.float32) for n, x in args.items()}
    expected = reference_on_host(ref_args, kw)
    self.assertEqual(actual[0].dtype, jnp.bfloat16)
    # Output rounded to bf16 (8 bits of mantissa): 2e-2 relative L2 allowed.
    assert_all_close(actual, expected, rtol=testing.RTOL[np.dtype(
        jnp.bfloat16)])

  def test_extreme_decays_stay_finite(self):
    # Log decays of -1000 per token and lower_bound=-5 gates both saturate
    # every exp; a factorised exp(G_i) exp(-G_j) would give inf * 0 = NaN.
    for case in (Case(t=128, gate="preactivated", g_min=-1000.0),
                 Case(t=128, gate="lower_bound")):
      args, kw = make_inputs(case)
      o, s, g = jax.jit(lambda a: loss_and_grads(a, kw, "chunked"))(args)
      chex.assert_tree_all_finite((o, s, g))


class ChunkedBlockSizeTest(parameterized.TestCase):
  """The exp split is safe for every bound (whatever block the tuning picks)."""

  def test_every_block_keeps_its_factors_finite(self):
    for chunk in (16, 64):
      for bound in np.linspace(-5.0, -0.05, 60):
        block, bounded = chunked.block_size(float(bound), True, chunk)
        assert bounded and chunk % block == 0, (chunk, bound, block)
        # The largest factor exp(-incl) of a block: finite in float32.
        assert np.isfinite(np.exp(np.float32(block * -bound))), (bound, block)
      # Without a bound there is none to factor by: the runtime-check path.
      for bound, fused in ((None, True), (-1.0, False)):
        assert not chunked.block_size(bound, fused, chunk)[1]

class ChunkedGroupsTest(parameterized.TestCase):
  # Without segments the chunks run in groups (chunked.group_size, ~16
  # chunk-heads of 64 tokens at K = 64 per scan step): small cases hold one
  # group, so these shrink the group width to force several groups, a
  # padded last group, and every block size (b=1, h=2, k=16: width 32 per
  # chunk; the groups hold the same tokens, 4x the chunks, at chunk 16).

  @parameterized.named_parameters(
      ("groups_of_1", 32, 64, Case(t=257, b=1)),
      ("groups_of_2_padded_bound_2_5", 64, 64, Case(t=257, b=1,
                                                     lower_bound=-2.5)),
      ("groups_of_3_bound_1", 96, 64, Case(t=257, b=1, lower_bound=-1.0)),
      ("groups_of_2_decay_minus_1000", 64, 64, Case(
          t=200, b=1, gate="preactivated", g_min=-1000.0)),
      ("chunk16_groups_of_4", 32, 16, Case(t=257, b=1)),
      ("chunk16_groups_of_8_decay_minus_1000", 64, 16, Case(
          t=200, b=1, gate="preactivated", g_min=-1000.0)),
  )
  def test_forward_and_gradients(self, width, size, case):
    args, kw = make_inputs(case)
    tuned = dict(kw, chunk_size=size, group_width=width)
    actual = jax.jit(lambda a: loss_and_grads(a, tuned, "chunked"))(args)
    expected = reference_on_host(args, kw)
    assert_all_close(actual, expected, rtol=1e-5)

  def test_groups_cover_every_chunk_with_little_padding(self):
    for num_chunks in range(1, 300, 7):
      for batch_heads, head_dim, chunk in ((4, 64, 64), (16, 128, 64),
                                           (1, 16, 64), (4, 64, 16)):
        size, groups = chunked.group_size(num_chunks, batch_heads, head_dim,
                                          chunk)
        assert 1 <= size <= chunked_grouped.MAX_GROUP_CHUNKS
        assert size * groups >= num_chunks
        # Padding the last group wastes less than one chunk per group.
        assert size * groups - num_chunks < groups, (num_chunks, size, groups)


class MosaicVsReferenceTest(parameterized.TestCase):
  """tokamax's Pallas kernel, run in interpret mode on CPU (seconds a call)."""

  def skip_on_tpu(self):
    if jax.default_backend() == "tpu":
      # Interpret mode is the kernel's check off TPU. Run on a v5e, these
      # cases missed by 2.0-2.4e-3 on the output (benchmarks/results/
      # tpu_suite_v5e/tpu-tests-ops_kda.xml; the interpreter's ops run on
      # the chip, at its arithmetic), and the v5e refuses the compiled
      # kernel (tokamax_kernel.V5E_MEASURED).
      self.skipTest("Pallas interpret mode is the kernel's check off TPU;"
                    " on a TPU the interpreter runs at the chip's arithmetic")

  @parameterized.named_parameters(
      ("fused_lower_bound_t64", Case(b=1, t=64, h=2, k=32, v=32)),
      ("preactivated_segments_t100", Case(b=1, t=100, h=1, k=32, v=32,
                                          gate="preactivated",
                                          segments=True)),
      # Measured relative L2 vs reference: every gradient <= 8.7e-6 but
      # da_log 3.6e-5 (chunked: 1.8e-6); tokamax's da_log on this draw is
      # 3.5e-5 with beta <= 1 too, so the looser bound is the kernel's, not
      # the features'.
      ("gva_neg_eigval_t64", Case(b=1, t=64, h=1, hv=2, k=32, v=32,
                                  beta_max=2.0), 1e-4),
  )
  def test_forward_and_gradients(self, case, rtol=1e-5):
    self.skip_on_tpu()
    args, kw = make_inputs(case)
    with interpret.interpret_mode():
      actual = loss_and_grads(args, kw, "mosaic")
    expected = reference_on_host(args, kw)
    assert_all_close(actual, expected, rtol=rtol)

  @pytest.mark.slow
  def test_any_segment_layout_forward_and_gradients(self):
    self.skip_on_tpu()
    # Leading and inner padding, ids out of order and skipped, a segment
    # that continues across padding (one run), a segment absent from a row.
    args, kw = make_inputs(Case(b=2, t=70, h=1, k=16, v=8, segments=True))
    seg = np.zeros((2, 70), np.int32)
    seg[0] = [0] * 5 + [2] * 20 + [1] * 15 + [0] * 5 + [1] * 10 + [4] * 15
    seg[1] = [3] * 30 + [0] * 6 + [3] * 14 + [2] * 20
    kw["segment_ids"] = jnp.asarray(seg)
    with interpret.interpret_mode():
      actual = loss_and_grads(args, kw, "mosaic")
    expected = reference_on_host(args, kw)
    assert_all_close(actual, expected, rtol=1e-5)
    # A segment that comes back after another is a run more than the
    # segments: with states, more runs than slots cannot run.
    seg[1] = [1] * 20 + [2] * 20 + [1] * 20 + [3] * 5 + [4] * 5
    kw["segment_ids"] = jnp.asarray(seg)
    with interpret.interpret_mode(), self.assertRaisesRegex(
        NotImplementedError, "a row here has 5 runs"):
      ops.kimi_delta_attention(**args, output_final_state=True,
                               backend="mosaic", **kw)

  def test_limits_raise_not_implemented(self):
    # No initial state: with one, a T = 63 piece is a decode piece (chunked).
    args, kw = make_inputs(Case(b=1, t=63, h=1, k=16, v=16, init=False))
    if jax.default_backend() != "tpu":  # the off-TPU refusal
      with self.assertRaisesRegex(NotImplementedError, "interpret"):
        ops.kimi_delta_attention(**args, backend="mosaic", **kw)
    with interpret.interpret_mode():
      with self.assertRaisesRegex(NotImplementedError, "multiple of 64"):
        ops.kimi_delta_attention(**args, backend="mosaic", **kw)
      args64, kw64 = make_inputs(Case(b=1, t=64, h=1, k=16, v=16,
                                      gate="softplus"))
      with self.assertRaisesRegex(NotImplementedError, "lower_bound"):
        ops.kimi_delta_attention(**args64, backend="mosaic", **kw64)
      big, kwb = make_inputs(Case(b=1, t=64, h=1, k=320, v=8, init=False))
      with self.assertRaisesRegex(NotImplementedError, "K <= 256"):
        ops.kimi_delta_attention(**big, backend="mosaic", **kwb)


class ValidationTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.args, self.kw = make_inputs(Case(t=8, init=False))

  def call(self, **overrides):
    kw = dict(self.kw, **{k: v for k, v in overrides.items()
                          if k not in self.args})
    args = dict(self.args, **{k: v for k, v in overrides.items()
                              if k in self.args})
    return ops.kimi_delta_attention(**args, **kw)

  @parameterized.named_parameters(
      ("k_shape", dict(k=jnp.zeros((2, 8, 2, 15))), "k must have shape"),
      ("v_heads", dict(v=jnp.zeros((2, 8, 3, 24))), "v must have shape"),
      ("beta_shape", dict(beta=jnp.zeros((2, 8))), "beta must have shape"),
      ("g_shape", dict(g=jnp.zeros((2, 7, 2, 16))), "g must have shape"),
      ("lower_bound_low", dict(lower_bound=-6.0), "lower_bound"),
      ("lower_bound_zero", dict(lower_bound=0.0), "lower_bound"),
      ("lower_bound_nan", dict(lower_bound=float("nan")), "lower_bound"),
      ("lower_bound_inf", dict(lower_bound=float("-inf")), "lower_bound"),
      ("missing_a_log", dict(a_log=None), "a_log"),
      ("a_log_shape", dict(a_log=jnp.zeros(3)), "a_log"),
      ("dt_bias_shape", dict(dt_bias=jnp.zeros(5)), "dt_bias"),
      ("backend", dict(backend="cuda"), "backend"),
      ("init_shape", dict(initial_state=jnp.zeros((2, 2, 16, 23))),
       "initial_state"),
      ("scale", dict(scale=-1.0), "scale"),
      ("segment_shape", dict(segment_ids=jnp.ones((2, 7), jnp.int32)),
       "segment_ids"),
      ("gva_g_heads", dict(v=jnp.zeros((2, 8, 4, 24))), "g must have shape"),
      ("beta_above_one", dict(beta=jnp.full((2, 8, 2), 1.5)),
       r"beta must lie in \[0, 1\] \(allow_neg_eigval"),
      ("beta_negative", dict(beta=jnp.full((2, 8, 2), -0.1),
                             allow_neg_eigval=True), r"beta must lie in \[0, 2\]"),
      ("beta_above_two", dict(beta=jnp.full((2, 8, 2), 2.5),
                              allow_neg_eigval=True), r"beta must lie in \[0, 2\]"),
      ("neg_eigval_flag", dict(allow_neg_eigval=1), "allow_neg_eigval"),
  )
  def test_bad_input_names_the_argument(self, overrides, message):
    with self.assertRaisesRegex(ValueError, message):
      self.call(**overrides)

  def test_segment_states_need_max_num_segments(self):
    seg = jnp.ones((2, 8), jnp.int32)
    with self.assertRaisesRegex(ValueError, "max_num_segments"):
      self.call(segment_ids=seg, max_num_segments=None,
                output_final_state=True)
    with self.assertRaisesRegex(ValueError, "initial_state"):
      self.call(segment_ids=seg, max_num_segments=2,
                initial_state=jnp.zeros((2, 2, 16, 24)))


class SegmentsWithoutStatesTest(parameterized.TestCase):

  @parameterized.parameters("reference", "chunked")
  def test_segments_without_max_num_segments(self, backend):
    # No states in or out: max_num_segments is not needed.
    args, kw = make_inputs(Case(t=100, segments=True, init=False))
    kw = dict(kw, max_num_segments=None)
    o, state = ops.kimi_delta_attention(**args, backend=backend, **kw)
    self.assertIsNone(state)
    o_np, _ = kda_numpy(**args, **kw)
    testing.assert_close(o, o_np, rtol=1e-5, name="output")
