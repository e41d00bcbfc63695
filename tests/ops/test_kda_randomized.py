"""Randomized differential tests of the KDA op (hypothesis).

What is randomized (one hypothesis example = one call configuration,
`Example`):

* shapes: B in 1..3, T in 1..300, H in 1..3, K and V in 1..40 (any size, not
  only multiples of 8);
* the gate: a pre-activated log decay g ~ U(g_min, 0) (g_min in [-8, -0.01],
  or -30, or -1000), the fused softplus gate (`use_gate_in_kernel=True`,
  `lower_bound=None`), or the fused lower-bound gate (`lower_bound` in
  [-5, -0.5]); the fused gates also get random `a_log` [H] and `dt_bias`
  [H * K];
* `scale` (None, or a random positive float) and `use_qk_l2norm` (when off,
  the generator normalises the rows of k, so the recurrence stays a
  contraction);
* packed segments (half the examples): per row, up to 6 runs of random
  lengths (the chunk edges 15, 16, 17, 32, 63, 64, 65, 128 drawn often), each
  with an id drawn from 0..N (0 = padding): padding anywhere, whole rows of
  padding, segments that repeat, come out of order or never appear;
  `max_num_segments=N` (1..5);
* an optional initial state ([B, H, K, V], or [B, N, H, K, V] with segments);
* for `chunked`, its tuning knobs: the chunk size (16, the CPU default, or
  64, the accelerator one) and the width of the grouped scan (as is, or
  narrow enough to force one chunk per group).

Array values come from a NumPy Generator seeded by a hypothesis-drawn seed
(hypothesis draws the structure, not the elements).

What is compared (relative L2, as in tests/ops/test_kda.py):

* `reference` and `chunked`: output and final state against the float64
  NumPy oracle `tests.kda_oracle.kda_numpy`, at 1e-5
  (`testing.RTOL[float32]`; float32 inputs, x64 stays off);
* `chunked` against `reference`: the gradients of a random-cotangent loss
  `sum(o * do) + sum(final_state * dstate)` with respect to every
  differentiable argument (q, k, v, g, beta, a_log, dt_bias, initial_state)
  at 1e-5, with floors on the denominator (`assert_grad_close`): an RMS of
  1e-2 (an RMS error of 1e-7, float32 rounding of O(1) terms, always
  passes: where the exact gradient is zero, as dg of a row's first token
  without an initial state, chunked leaves a ~1e-9..1e-8 rounding residue,
  which dominates a dg made small by strong decays), scaled by the gate's
  derivatives for the raw g, dt_bias and a_log under a fused gate; and for
  a_log and dt_bias, sums over all tokens whose terms can cancel, the L1
  mass of those terms (`reduction_mass`);
* `mosaic` (tokamax's Pallas kernel, on CPU in Pallas interpret mode through
  `interpret.interpret_mode()`): output and final state against the oracle at
  1e-5, forward only, on a restricted strategy: B, H <= 2, T <= 128; the
  kernel's limits (T a multiple of 64 without segments, no fused softplus
  gate, pre-activated decays >= -5); every segment layout the other
  backends take (leading and inner padding, ids out of order, repeated or
  skipped: the adapter brings each row to the kernel's canonical form, see
  ops/kda/mosaic.py), except rows with more runs than max_num_segments,
  which must raise NotImplementedError (the kernel holds a state per run).

Profiles (registered here; the environment variable
LINEAR_ATTENTION_HYPOTHESIS_PROFILE picks one):

* "ci" (default): the explicit examples (`CI_EXAMPLE`, `MOSAIC_CI_EXAMPLE`)
  and one derandomized draw (the same on every run: the all-minimal shape,
  T = 1) for reference and chunked, no shrinking; ~60 s of CPU, nearly all
  of it XLA compiles and mosaic's interpret-mode trace;
* "thorough": 300 random examples, and a tenth as many for mosaic, with
  shrinking, e.g.

    LINEAR_ATTENTION_HYPOTHESIS_PROFILE=thorough \\
      .venv/bin/python -m pytest -q -x tests/ops/test_kda_randomized.py

  LINEAR_ATTENTION_HYPOTHESIS_MAX_EXAMPLES=N sets the count under either
  profile (mosaic's: N // 10 under "thorough"); `--hypothesis-seed=S`
  replays a random run. A failure prints its example and a
  `@reproduce_failure` blob.

Each example costs seconds (a new jit compile of reference and chunked,
forward and backward: ~5-25 s on a busy 2-core machine). No example database
is written (`database=None`).
"""

import dataclasses
import os

from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import settings
from hypothesis import strategies as st
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.training import interpret
from linear_attention import ops
from linear_attention import testing
from tests import kda_oracle
from tests.kda_oracle import kda_numpy
from tests.ops.test_kda import loss_and_grads

PROFILE_ENV = "LINEAR_ATTENTION_HYPOTHESIS_PROFILE"
MAX_EXAMPLES_ENV = "LINEAR_ATTENTION_HYPOTHESIS_MAX_EXAMPLES"
_COMMON = dict(
    deadline=None,  # every example compiles new shapes (seconds each)
    database=None,  # no example database (hypothesis still caches in .hypothesis/, which holds its own .gitignore)
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# CI: the same few examples on every run, and no shrinking (a shrink
# compiles a new example per step, minutes): a failure prints the example
# as drawn and a `@reproduce_failure` blob to replay it.
settings.register_profile(
    "ci", max_examples=1, derandomize=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate), **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
PROFILE = os.environ.get(PROFILE_ENV, "ci")
# Applied per test (not `settings.load_profile`): other modules keep theirs.
SETTINGS = settings.get_profile(PROFILE)
if os.environ.get(MAX_EXAMPLES_ENV):  # a run of a chosen length
  SETTINGS = settings(SETTINGS,
                      max_examples=int(os.environ[MAX_EXAMPLES_ENV]))
# Mosaic examples cost a 15-40 s interpret-mode trace each: a tenth as many
# as the other test, and in CI only the explicit example
# (`MOSAIC_CI_EXAMPLE`), which covers more than the first derandomized draw
# (the all-minimal shape) would.
MOSAIC_SETTINGS = settings(
    SETTINGS, max_examples=max(1, SETTINGS.max_examples // 10))
if PROFILE == "ci":
  MOSAIC_SETTINGS = settings(MOSAIC_SETTINGS, phases=(Phase.explicit,))

RTOL = testing.RTOL[np.dtype("float32")]  # 1e-5 relative L2
# Gradients of a smaller RMS are compared in absolute terms (RMS error up to
# RTOL * GRAD_FLOOR = 1e-7; see `assert_grad_close`).
GRAD_FLOOR = 1e-2
GATES = ("preactivated", "softplus", "lower_bound")


@dataclasses.dataclass(frozen=True)
class Example:
  """One drawn configuration (hypothesis prints it on a failure)."""
  b: int
  t: int
  h: int
  k: int
  v: int
  gate: str  # one of GATES
  g_min: float  # pre-activated log decays: U(g_min, 0)
  lower_bound: float | None  # the lower-bound gate's bound
  scale: float | None
  l2norm: bool
  # Per row, the segment ids as (id, length) runs (0 = padding), or None.
  segments: tuple[tuple[tuple[int, int], ...], ...] | None
  num_segments: int | None  # max_num_segments with segments
  init: bool
  seed: int
  chunk: int = 16  # chunked: tokens per chunk
  group_width: int | None = None  # chunked: grouped.GROUP_WIDTH (None: as is)


# Run lengths: anything up to T, with the chunk edges 16 and 64 (and their
# neighbours) drawn more often than by chance.
_EDGE_LENGTHS = (15, 16, 17, 32, 63, 64, 65, 128)


def _runs(row):
  """A row of ids as ((id, length), ...) runs (how examples print)."""
  runs = []
  for seg in row:
    if runs and runs[-1][0] == seg:
      runs[-1][1] += 1
    else:
      runs.append([seg, 1])
  return tuple(map(tuple, runs))


@st.composite
def _row_layout(draw, t, n):
  """One row of segment ids as runs: random lengths and ids in 0..n."""
  length = st.one_of(st.integers(1, t), st.sampled_from(_EDGE_LENGTHS))
  runs = draw(st.lists(st.tuples(length, st.integers(0, n)), min_size=1,
                       max_size=6))
  row = []
  for size, seg in runs:
    row += [seg] * size
  row += [runs[-1][1]] * (t - len(row))  # the last run fills the row
  return _runs(row[:t])


@st.composite
def examples(draw, *, mosaic_only=False):
  """Configurations for `chunked` and `reference`, or for `mosaic`."""
  small = mosaic_only  # mosaic's interpret mode costs seconds per chunk-head
  b = draw(st.integers(1, 2 if small else 3))
  h = draw(st.integers(1, 2 if small else 3))
  kd = draw(st.integers(1, 40))
  vd = draw(st.integers(1, 40))
  use_segments = draw(st.booleans())
  if mosaic_only and not use_segments:
    t = draw(st.sampled_from((64, 128)))  # mosaic: T % 64 == 0 unsegmented
  else:
    t = draw(st.integers(1, 128 if small else 300))
  gate = draw(st.sampled_from(GATES[::2] if mosaic_only else GATES))
  g_min = -1.0
  if gate == "preactivated":
    # Mosaic factors exp(G_i - G_j) over 16-token sub-chunks: the op leaves
    # decays far below -5 to the caller there (see ops/kda/mosaic.py).
    g_min = draw(st.floats(-5.0, -0.01) if mosaic_only else st.one_of(
        st.floats(-8.0, -0.01), st.sampled_from((-30.0, -1000.0))))
  lower_bound = (draw(st.floats(-5.0, -0.5)) if gate == "lower_bound"
                 else None)
  scale = draw(st.one_of(st.none(), st.floats(0.05, 4.0)))
  l2norm = draw(st.booleans())
  segments = num_segments = None
  if use_segments:
    num_segments = draw(st.integers(1, 5))
    segments = tuple(draw(_row_layout(t, num_segments)) for _ in range(b))
  init = draw(st.booleans())
  seed = draw(st.integers(0, 2**32 - 1))
  chunk, group_width = 16, None
  if not mosaic_only:
    chunk = draw(st.sampled_from((16, 64)))
    group_width = draw(st.sampled_from((None, 1)))
  return Example(b=b, t=t, h=h, k=kd, v=vd, gate=gate, g_min=g_min,
                 lower_bound=lower_bound, scale=scale, l2norm=l2norm,
                 segments=segments, num_segments=num_segments, init=init,
                 seed=seed, chunk=chunk, group_width=group_width)


def make_inputs(ex: Example):
  """(array args, static/keyword args) of the op for an example."""
  rng = np.random.default_rng(ex.seed)
  normal = lambda *s: rng.normal(size=s).astype(np.float32)
  args = dict(q=normal(ex.b, ex.t, ex.h, ex.k),
              k=normal(ex.b, ex.t, ex.h, ex.k),
              v=normal(ex.b, ex.t, ex.h, ex.v),
              beta=rng.uniform(0.0, 1.0, (ex.b, ex.t, ex.h)).astype(
                  np.float32))
  if not ex.l2norm:  # unit keys: I - beta k k^T stays a contraction
    norm = np.linalg.norm(args["k"], axis=-1, keepdims=True)
    args["k"] = (args["k"] / np.maximum(norm, 1e-3)).astype(np.float32)
  kw = dict(scale=ex.scale, use_qk_l2norm=ex.l2norm)
  if ex.gate == "preactivated":
    args["g"] = rng.uniform(ex.g_min, 0.0, (ex.b, ex.t, ex.h, ex.k)).astype(
        np.float32)
  else:
    args["g"] = normal(ex.b, ex.t, ex.h, ex.k) * 2.0
    args["a_log"] = np.log(rng.uniform(0.5, 16.0, ex.h)).astype(np.float32)
    args["dt_bias"] = normal(ex.h * ex.k) * 0.5
    kw.update(use_gate_in_kernel=True, lower_bound=ex.lower_bound)
  if ex.segments is not None:
    ids = [sum(([seg] * size for seg, size in row), []) for row in ex.segments]
    kw.update(segment_ids=jnp.asarray(np.array(ids, np.int32)),
              max_num_segments=ex.num_segments)
  if ex.init:
    shape = ((ex.b,) + (() if ex.segments is None else (ex.num_segments,))
             + (ex.h, ex.k, ex.v))
    args["initial_state"] = normal(*shape) * 0.5
  return {n: jnp.asarray(x) for n, x in args.items()}, kw


def run_xla_backend(ex: Example, args, kw, backend):
  """`loss_and_grads` under jit, with chunked's knobs set for the trace."""
  # kw holds arrays (segment ids): close over it; a fresh lambda per call
  # traces again.
  if backend == "chunked":
    kw = dict(kw, chunk_size=ex.chunk, group_width=ex.group_width)
  fn = jax.jit(lambda a: loss_and_grads(a, kw, backend, seed=ex.seed + 1))
  return jax.device_get(fn(args))


def assert_grad_close(actual, expected, name, mass=None, chain=None):
  """Relative L2 error <= RTOL against a floored denominator.

  The denominator is the largest of ||expected||, GRAD_FLOOR * sqrt(size),
  and, for the gradients that pass through the gate, ||mass|| and
  GRAD_FLOOR * ||chain||.

  GRAD_FLOOR. Where the exact gradient is zero, chunked's is a float32
  rounding residue of cancelling O(1) terms (its exp(G_i - G_j) factors are
  products of exponentials): dg of the first token of a row without an
  initial state (the state its decay multiplies is zero) comes out at
  ~1e-9..1e-8, an infinite relative error, and strong decays make every
  entry of dg small (dg ~ exp(g) S), so that residue dominates the norm
  (found: T = 2, g in U(-7, 0): ||dg|| = 4e-4, residue 4e-9, error 1.1e-5).
  A gradient of RMS below GRAD_FLOOR = 1e-2 is so compared in absolute
  terms: an RMS error up to RTOL * GRAD_FLOOR = 1e-7, float32 rounding
  (eps 6e-8) of the O(1) terms of these O(1) inputs and N(0, 1) cotangents.

  `chain` (`gate_chain`). Under a fused gate that residue is in the gradient
  of the activated decay, and reaches the raw g, dt_bias and a_log times
  the gate's derivatives (up to ~16 for the raw gate, ~80 for a_log): their
  floor is GRAD_FLOOR times the L2 norm of those derivatives (found: T = 1,
  softplus gate, da_log exactly 0, chunked 1.1e-7).

  `mass` (`reduction_mass`). The gradients of a_log [H] and dt_bias [H * K]
  are sums over every token of terms that can cancel: the sum is only as
  accurate as eps times the mass sum |terms|, not its value (found: B = 2,
  T = 269, K = 1, lower_bound -2.36: da_log = 1.48 out of sum |terms| =
  337; chunked's dg is 1.6e-6 from float64 (reference's 1.8e-7), its da_log
  6.7e-5 relative, 3e-7 of the mass).
  """
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  norm = lambda x: 0.0 if x is None else float(np.linalg.norm(x))
  denom = max(norm(expected), norm(mass), GRAD_FLOOR * norm(chain),
              GRAD_FLOOR * np.sqrt(expected.size))
  err = float(np.linalg.norm(actual - expected)) / denom
  assert err <= RTOL, f"{name}: relative L2 error {err:.3e} > {RTOL:.1e}"


def gate_chain(ex: Example, args):
  """d(log decay)/dx and d(log decay)/d a_log per token, x = g + dt_bias.

  Lower-bound gate lb * sigmoid(r x), r = exp(a_log): lb s (1 - s) r and
  that times x; softplus gate -r softplus(x): -r sigmoid(x) and
  -r softplus(x). float64, [B, T, H, K].
  """
  x = (np.asarray(args["g"], np.float64)
       + np.asarray(args["dt_bias"], np.float64).reshape(ex.h, ex.k))
  r = np.exp(np.asarray(args["a_log"], np.float64))[:, None]
  if ex.gate == "lower_bound":
    sig = kda_oracle.sigmoid(r * x)
    dx = ex.lower_bound * sig * (1.0 - sig) * r
    return dx, dx * x
  return -r * kda_oracle.sigmoid(x), -r * kda_oracle.softplus(x)


def reduction_mass(ex: Example, args, dg_raw):
  """sum |terms| of the a_log and dt_bias gradients, from dL/dg (raw gate).

  With x = g + dt_bias: d/d dt_bias = sum over (b, t) of dL/dx, and each
  term of d/d a_log is dL/dx times (dgate/da_log) / (dgate/dx): x for the
  lower-bound gate, softplus(x) / sigmoid(x) for the softplus gate.
  """
  dg_raw = np.asarray(dg_raw, np.float64)
  x = (np.asarray(args["g"], np.float64)
       + np.asarray(args["dt_bias"], np.float64).reshape(ex.h, ex.k))
  ratio = (x if ex.gate == "lower_bound"
           else kda_oracle.softplus(x) / kda_oracle.sigmoid(x))
  return dict(a_log=np.abs(dg_raw * ratio).sum(axis=(0, 1, 3)),
              dt_bias=np.abs(dg_raw).sum(axis=(0, 1)).reshape(-1))


def assert_matches_oracle(o, state, args, kw, backend):
  o_np, s_np = kda_numpy(**args, **kw)
  testing.assert_close(o, o_np, rtol=RTOL, name=f"{backend} output")
  testing.assert_close(state, s_np, rtol=RTOL, name=f"{backend} final_state")


# Always run (CI's derandomized draws change with the strategy): packed
# rows with inner and leading padding, a run that continues across padding,
# ids out of order and repeated, initial states, the lower-bound gate. At the
# CPU chunk of 16 (chunk 64 compiles twice as long; random draws cover it).
CI_EXAMPLE = Example(
    b=2, t=150, h=2, k=24, v=20, gate="lower_bound", g_min=-1.0,
    lower_bound=-2.5, scale=0.5, l2norm=True,
    segments=(((0, 5), (2, 60), (1, 30), (0, 10), (1, 20), (3, 25)),
              ((3, 64), (0, 6), (3, 40), (2, 40))),
    num_segments=4, init=True, seed=11, chunk=16)


@SETTINGS
@hypothesis.given(ex=examples())
@hypothesis.example(ex=CI_EXAMPLE)
def test_reference_and_chunked_match_oracle_and_gradients_agree(ex):
  args, kw = make_inputs(ex)
  o_ref, s_ref, g_ref = run_xla_backend(ex, args, kw, "reference")
  assert_matches_oracle(o_ref, s_ref, args, kw, "reference")
  o, s, g = run_xla_backend(ex, args, kw, "chunked")
  assert_matches_oracle(o, s, args, kw, "chunked")
  assert g.keys() == g_ref.keys()
  mass, chain = {}, {}
  if "a_log" in g_ref:  # a fused gate
    mass = reduction_mass(ex, args, g_ref["g"])
    dx, dalog = gate_chain(ex, args)
    chain = dict(g=dx, dt_bias=dx, a_log=dalog)
  for name in g_ref:
    assert_grad_close(g[name], g_ref[name], f"chunked d{name} vs reference",
                      mass=mass.get(name), chain=chain.get(name))


# Packed rows with leading, inner and trailing padding, ids out of order, a
# segment continuing across padding, a whole row of padding, a segment
# absent from every row, initial states, the fused lower-bound gate, K and V
# not multiples of 8.
MOSAIC_CI_EXAMPLE = Example(
    b=3, t=70, h=1, k=20, v=12, gate="lower_bound", g_min=-1.0,
    lower_bound=-3.0, scale=None, l2norm=True,
    segments=(((0, 4), (3, 26), (0, 5), (3, 5), (1, 15), (0, 15)), ((0, 70),),
              ((1, 30), (2, 25), (0, 15))), num_segments=4,
    init=True, seed=7)


def _num_runs(segments):
  """The most runs in a row once its padding is removed."""
  return max(len(_runs([s for s, n in row for _ in range(n) if s]))
             for row in segments)


# Pallas interpret mode is tokamax's kernel's check off TPU. On a TPU the
# interpreter's ops run on the chip at its default precision (one bfloat16
# pass): measured on a v5e, MOSAIC_CI_EXAMPLE's output 2.3e-3 from the
# oracle (benchmarks/results/tpu_suite_v5e/
# 9653d15-tpu-tests-ops_random-cut_at_190s.xml), as the
# interpret-mode cases of tests/ops/test_kda.py (2.0e-3..2.4e-3).
@pytest.mark.skipif(jax.default_backend() == "tpu",
                    reason="Pallas interpret mode is the kernel's check off"
                    " TPU; on a TPU the interpreter runs at the chip's"
                    " default precision")
@MOSAIC_SETTINGS
@hypothesis.given(ex=examples(mosaic_only=True))
@hypothesis.example(ex=MOSAIC_CI_EXAMPLE)
def test_mosaic_interpret_matches_oracle(ex):
  args, kw = make_inputs(ex)
  if ex.segments and _num_runs(ex.segments) > ex.num_segments:
    with interpret.interpret_mode(), pytest.raises(
        NotImplementedError, match="runs each run of a segment"):
      ops.kimi_delta_attention(**args, output_final_state=True,
                               backend="mosaic", **kw)
    return
  with interpret.interpret_mode():
    o, state = ops.kimi_delta_attention(
        **args, output_final_state=True, backend="mosaic", **kw)
    o, state = jax.device_get((o, state))
  assert_matches_oracle(o, state, args, kw, "mosaic")
