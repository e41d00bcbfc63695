"""benchmarks/elementwise_accuracy.py on a CPU: its ulp count against known
spacings, and every function measured (the CPU's own errors, 0.5 to 2.5
ulp when written, bound the check loosely: a probe that mismeasures by a
factor of two or more fails)."""

import numpy as np

from benchmarks import elementwise_accuracy as ea


def test_ulps_counts_float32_spacings():
  x = np.array([1.0, 0.5, 3.0], np.float32)
  up = np.nextafter(x, np.float32(np.inf))
  got = ea.ulps(up.astype(np.float64), x.astype(np.float64))
  np.testing.assert_array_equal(got, [1.0, 1.0, 1.0])
  assert ea.ulps(np.float64(2.0), np.float64(2.0)) == 0.0


def test_every_function_is_measured():
  for name in ea.FUNCTIONS:
    row = ea.measure(name, n=1 << 14)
    assert 0.0 < row["max_ulp"] < 5.0, row
    assert abs(row["mean_signed_rel"]) <= row["mean_abs_rel"] < 1e-6, row
  rows = ea.decay_product(lengths=(8, 64))
  assert [r["n"] for r in rows] == [8, 64]
  assert all(r["max_abs_rel"] < 1e-5 for r in rows), rows
