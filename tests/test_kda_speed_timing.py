"""The speed harness's timing helpers (no timings are asserted)."""

from absl.testing import absltest
import jax.numpy as jnp

from benchmarks import kda_speed


def _recorder():
  """(calls, fn): fn(name) is an identity that appends name to calls."""
  calls = []

  def fn(name):
    def f(x):
      calls.append(name)
      return x
    return f

  return calls, fn


class TimingTest(absltest.TestCase):

  def test_paired_is_the_median_of_per_round_ratios(self):
    # Round 2 is a slow spell for both: its ratio is as good as any other.
    slow = [2.0, 8.0, 2.2, 2.0]
    fast = [1.0, 4.0, 1.0, 1.0]
    self.assertAlmostEqual(kda_speed.paired(slow, fast), 2.0)
    # A ratio of medians would read 2.1 / 1.0 here.
    self.assertAlmostEqual(kda_speed.paired([2.1, 9.0, 2.0], [1.0, 6.0, 1.0]),
                           2.0)

  def test_time_rounds_calls_everything_once_a_round(self):
    calls, fn = _recorder()
    times = kda_speed.time_rounds(
        {"a": fn("a"), "b": fn("b")}, (jnp.zeros(()),), repeats=3,
        extra={"mm": (fn("mm"), (jnp.ones(()),))})
    self.assertEqual({n: len(ts) for n, ts in times.items()},
                     {"a": 3, "b": 3, "mm": 3})
    # The order rotates: each name leads one round.
    self.assertEqual([calls[i] for i in (0, 3, 6)], ["a", "b", "mm"])

  def test_warm_calls_precede_each_timed_call(self):
    calls, fn = _recorder()
    times = kda_speed.time_rounds(
        {"a": fn("a"), "b": fn("b")}, (jnp.zeros(()),), repeats=2,
        warm_calls=2)
    self.assertEqual({n: len(ts) for n, ts in times.items()}, {"a": 2, "b": 2})
    self.assertEqual(calls, ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3)


if __name__ == "__main__":
  absltest.main()


class CommitsTest(absltest.TestCase):

  def test_an_extracted_commit_imports_beside_the_working_tree(self):
    import sys  # pylint: disable=g-import-not-at-top
    import tempfile  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from benchmarks import kda_commits  # pylint: disable=g-import-not-at-top
    from linear_attention import ops  # pylint: disable=g-import-not-at-top

    root = tempfile.mkdtemp()
    sys.path.insert(0, root)
    try:
      sha, old = kda_commits.extract("HEAD", root)
    finally:
      sys.path.remove(root)
    self.assertIsNot(old, ops)
    self.assertEqual(old.__name__, f"la_{sha}.ops")
    args = kda_speed.make_inputs(1, 40, 2, 8)
    got = kda_commits.forward(old)(*args)
    want = kda_commits.forward(ops)(*args)
    # The working tree may differ from HEAD, but not past float32 rounding
    # of this 40-token forward (each output a sum of <= 40 * 8 products).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
