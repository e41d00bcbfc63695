"""Input the op documents as invalid never gives a silently wrong answer.

Concrete input: `ValueError` naming the argument, the allowed range and the
offending values (NaN as nan). Traced input (under `jit`): the (row, head)
with a bad value returns NaN for its output row and states; every other
row equals the same call on valid input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops

B, T, H, K = 2, 8, 2, 8


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return dict(q=x(B, T, H, K), k=x(B, T, H, K), v=x(B, T, H, K),
              g=-jnp.abs(x(B, T, H, K)),
              beta=jnp.asarray(rng.uniform(0, 1, (B, T, H)), jnp.float32))


def op(args, **kw):
  kw.setdefault("use_qk_l2norm", True)
  return ops.kimi_delta_attention(**args, output_final_state=True, **kw)


@pytest.mark.parametrize("name, value, pattern", [
    ("beta", 1.5, r"beta must lie in \[0, 1\].*got 1 value\(s\) outside: 1\.5 at \(1, 3, 0\)"),
    ("beta", np.nan, r"beta must lie in \[0, 1\].*nan at \(1, 3, 0\)"),
    ("g", 5.0, r"g must lie in \[-inf, 0\] \(a log decay.*5 at \(1, 3, 0, 0\)"),
])
def test_concrete_values_out_of_range_raise(name, value, pattern):
  args = inputs()
  index = (1, 3, 0, 0) if name == "g" else (1, 3, 0)
  args[name] = args[name].at[index].set(value)
  with pytest.raises(ValueError, match=pattern):
    op(args)


@pytest.mark.parametrize("ids, pattern", [
    (3, r"segment_ids must lie in \[0, 2\] \(0 = padding, at most"
        r" max_num_segments\); got 1 value\(s\) outside: 3 at \(0, 5\)"),
    (-1, r"segment_ids must lie in \[0, 2\].*-1 at \(0, 5\)"),
])
def test_concrete_segment_ids_out_of_range_raise(ids, pattern):
  args = inputs()
  seg = np.ones((B, T), np.int32)
  seg[:, 4:] = 2
  seg[0, 5] = ids
  state = jnp.zeros((B, 2, H, K, K))
  with pytest.raises(ValueError, match=pattern):
    op(args, segment_ids=jnp.asarray(seg), max_num_segments=2,
       initial_state=state)


def _check_poisoned(bad_o, bad_s, good_o, good_s, rows):
  """rows: the (b, h) pairs that must be NaN; everything else must equal."""
  for b in range(B):
    for h in range(H):
      if (b, h) in rows:
        assert np.all(np.isnan(bad_o[b, :, h])), (b, h)
        assert np.all(np.isnan(bad_s[b, ..., h, :, :])), (b, h)
      else:
        np.testing.assert_allclose(bad_o[b, :, h], good_o[b, :, h],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(bad_s[b, ..., h, :, :],
                                   good_s[b, ..., h, :, :], rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("name, value", [("beta", 1.5), ("beta", np.nan),
                                         ("g", 5.0), ("g", np.nan)])
def test_traced_values_out_of_range_poison_their_rows(backend, name, value):
  args = inputs()
  good = jax.jit(lambda a: op(a, backend=backend))(args)
  index = (1, 3, 0, 2) if name == "g" else (1, 3, 0)
  args[name] = args[name].at[index].set(value)
  bad = jax.jit(lambda a: op(a, backend=backend))(args)
  _check_poisoned(*map(np.asarray, bad), *map(np.asarray, good), {(1, 0)})


@pytest.mark.parametrize("ids", [3, -1])
def test_traced_segment_ids_out_of_range_poison_their_row(ids):
  args = inputs()
  seg = np.ones((B, T), np.int32)
  seg[:, 4:] = 2
  state = jnp.zeros((B, 2, H, K, K))
  run = jax.jit(lambda a, s: op(a, segment_ids=s, max_num_segments=2,
                                initial_state=state, backend="chunked"))
  good = run(args, jnp.asarray(seg))
  seg[0, 5] = ids
  bad = run(args, jnp.asarray(seg))
  _check_poisoned(*map(np.asarray, bad), *map(np.asarray, good),
                  {(0, 0), (0, 1)})


def test_gradients_of_valid_rows_are_unchanged_by_a_bad_row():
  # The NaN of a bad row is a select: no NaN flows into the other rows'
  # gradients.
  args = inputs()
  loss = lambda a: jnp.sum(op(a, backend="chunked")[0][0])  # row 0 only
  good = jax.grad(loss)(args)
  args["beta"] = args["beta"].at[1, 3, 0].set(1.5)
  bad = jax.grad(loss)(args)
  for name in ("q", "k", "v", "g", "beta"):
    np.testing.assert_allclose(np.asarray(bad[name])[0],
                               np.asarray(good[name])[0], rtol=1e-6,
                               atol=1e-7)


def test_context_parallel_bad_value_poisons_its_row_on_every_rank():
  # beta = 1.5 on the second rank's shard of row 1, head 0: the row's output
  # on both ranks and the replicated final state are NaN; the rest match.
  from jax.sharding import PartitionSpec as P
  from tests.parallel import common
  args = inputs()
  names = sorted(args)
  seq = P(None, "context")

  def sharded(a):
    f = jax.shard_map(
        lambda *xs: op(dict(zip(names, xs)), backend="chunked",
                       context_axis="context"),
        mesh=common.mesh(2), in_specs=tuple(seq for _ in names),
        out_specs=(seq, P()))
    return f(*[a[n] for n in names])

  good = jax.jit(sharded)(args)
  args["beta"] = args["beta"].at[1, T - 1, 0].set(1.5)
  bad = jax.jit(sharded)(args)
  _check_poisoned(*map(np.asarray, bad), *map(np.asarray, good), {(1, 0)})
