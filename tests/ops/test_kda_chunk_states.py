"""Chunk-boundary states (`output_chunk_states`) against the float64 oracle.

Entry j must be the state right after token (j + 1) C - 1: the float64
NumPy recurrence run on the prefix of (j + 1) C tokens gives it as the final
state of the segment holding that token (zeros at padding). Checked for
values and, by central differences, for gradients, on one device and under
context parallelism, with packed segments, padding and initial states.
"""


import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from tests.kda_oracle import kda_numpy
from tests.ops import test_gradient_anchors as anchors
from tests.parallel import common as cp_common

AXIS = "context"


@pytest.fixture(autouse=True)
def x64():
  # Every test here is float64: on the host's CPU on any host (on a TPU
  # float64 is emulated, minutes a test; `testing.float64_on_host`).
  with testing.float64_on_host():
    yield


def oracle_chunk_states(args, kw, every):
  """[B, T // every, H, K, V] from the oracle's final states of prefixes."""
  b, t = args["q"].shape[:2]
  ids = kw.get("segment_ids")
  out = []
  for j in range(t // every):
    p = (j + 1) * every
    cut = {n: (x if n in ("a_log", "dt_bias", "initial_state") else x[:, :p])
           for n, x in args.items()}
    pkw = dict(kw, **({} if ids is None else dict(segment_ids=ids[:, :p])))
    _, final = kda_numpy(**cut, **pkw)
    if ids is None:
      out.append(final)
      continue
    last = np.asarray(ids)[:, p - 1]
    out.append(np.stack([final[i, last[i] - 1] if last[i] else
                         np.zeros(final.shape[2:]) for i in range(b)]))
  return np.stack(out, axis=1)


def run(args, kw, backend, every, num_ranks=None, chunk_size=16):
  names = sorted(args)
  seq = ("q", "k", "v", "g", "beta")
  ids = kw.get("segment_ids")
  static = {n: x for n, x in kw.items() if n != "segment_ids"}

  def op(*xs):
    a = dict(zip(names, xs[:len(names)]))
    return ops.kimi_delta_attention(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a_log=a.get("a_log"),
        dt_bias=a.get("dt_bias"), initial_state=a.get("initial_state"),
        segment_ids=xs[-1] if ids is not None else None,
        output_final_state=True, output_chunk_states=True,
        chunk_states_every=every, backend=backend, chunk_size=chunk_size,
        context_axis=None if num_ranks is None else AXIS, **static)

  xs = [args[n] for n in names] + ([ids] if ids is not None else [])
  if num_ranks is None:
    return op(*xs)
  specs = tuple(P(None, AXIS) if n in seq else P() for n in names)
  specs += (P(None, AXIS),) if ids is not None else ()
  return jax.shard_map(op, mesh=cp_common.mesh(num_ranks), in_specs=specs,
                       out_specs=(P(None, AXIS), P(), P(None, AXIS)))(*xs)


def loss_fn(kw, backend, every, shapes, num_ranks=None, seed=5):
  rng = np.random.default_rng(seed)
  cots = [jnp.asarray(rng.normal(size=s)) for s in shapes]

  def loss(args):
    outs = run(args, kw, backend, every, num_ranks)
    return sum(jnp.sum(x * c) for x, c in zip(outs, cots))

  return loss


CASES = {
    "lower_bound": dict(gate="lower_bound", segments=False, init=True),
    "segments_padding": dict(gate="softplus", segments=True, init=True),
    "segments_no_init": dict(gate="preactivated", segments=True, init=False),
}


# C = 7 leaves a partial last piece (T = 40); chunked compiles slowly in
# float64, so it takes C = 8 (pieces of half a 16-token chunk) only.
@pytest.mark.parametrize("backend,every", [("reference", 8),
                                           ("reference", 7), ("chunked", 8)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunk_states_match_the_float64_oracle(backend, case, every):
  args, kw = anchors.make_case(**CASES[case])  # T = 40
  o, final, states = jax.jit(lambda a: run(a, kw, backend, every))(args)
  o_np, final_np = kda_numpy(**args, **kw)
  testing.assert_close(o, o_np, rtol=1e-12, name="output")
  testing.assert_close(final, final_np, rtol=1e-12, name="final_state")
  want = oracle_chunk_states(args, kw, every)
  assert states.shape == want.shape == (3, 40 // every, 2, 8, 6)
  assert states.dtype == jnp.float64
  testing.assert_close(states, want, rtol=1e-12, name="chunk_states")
  # exact: chunk_states writes jnp.where(ends_valid, state, 0) there.
  if "segment_ids" in kw:  # boundaries on padding are exactly zero
    pad = np.asarray(kw["segment_ids"])[:, every - 1::every][:, :40 // every]
    assert pad.min() == 0
    np.testing.assert_array_equal(np.asarray(states)[pad == 0], 0.0)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_chunk_state_gradients_match_finite_differences(backend):
  args, kw = anchors.make_case(gate="softplus", segments=True, init=True,
                               value_heads=4, neg_eigval=True)
  shapes = [x.shape for x in jax.jit(
      lambda a: run(a, kw, backend, 8))(args)]
  loss = loss_fn(kw, backend, 8, shapes)
  anchors.check_against_finite_differences(
      loss, args, [n for n in anchors.DIFF if n in args])


def test_context_parallel_chunk_states_are_the_global_ones():
  args, kw = anchors.make_case(gate="lower_bound", segments=True, init=True)
  o, final, states = jax.jit(
      lambda a: run(a, kw, "reference", 5, num_ranks=4))(args)  # 10 a rank
  testing.assert_close(states, oracle_chunk_states(args, kw, 5), rtol=1e-12,
                       name="chunk_states")
  o_np, final_np = kda_numpy(**args, **kw)
  testing.assert_close(o, o_np, rtol=1e-12, name="output")
  testing.assert_close(final, final_np, rtol=1e-12, name="final_state")
  loss = loss_fn(kw, "reference", 5, [o.shape, final.shape, states.shape],
                 num_ranks=4)
  anchors.check_against_finite_differences(
      loss, args, [n for n in anchors.DIFF if n in args])


def test_bad_chunk_state_arguments():
  args, kw = anchors.make_case(gate="lower_bound", segments=False, init=True)
  call = lambda **o: ops.kimi_delta_attention(
      args["q"], args["k"], args["v"], args["g"], args["beta"],
      a_log=args["a_log"], dt_bias=args["dt_bias"], **dict(kw, **o))
  with pytest.raises(ValueError, match="chunk_states_every"):
    call(output_chunk_states=True, chunk_states_every=0)
  with pytest.raises(ValueError, match="output_chunk_states"):
    call(output_chunk_states=1)
  with pytest.raises(NotImplementedError, match="tokamax"):
    call(output_chunk_states=True, backend="mosaic")
  # Under context parallelism every rank's slice must hold whole chunks.
  with pytest.raises(ValueError, match="chunk_states_every"):
    jax.jit(lambda a: run(a, kw, "reference", 7, num_ranks=4))(args)
  # T shorter than C: no boundary, an empty array.
  assert call(output_chunk_states=True, chunk_states_every=64)[2].shape == (
      3, 0, 2, 8, 6)
