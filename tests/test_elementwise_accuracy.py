"""benchmarks/elementwise_accuracy.py, run on the host CPU whatever the
default device: its ulp count against known spacings, and every function
measured within a window around the CPU's own errors (0.5 to 2.5 ulp and
mean relative errors of 1.5e-8 to 3.0e-8 when written,
`benchmarks/results/elementwise_accuracy_cpu.json`): a probe that reads
ulps or relative errors wrongly by a factor of four fails."""

import jax
import numpy as np

from benchmarks import elementwise_accuracy as ea
from linear_attention.ops.kda import gates


def test_ulps_counts_float32_spacings():
  x = np.array([1.0, 0.5, 3.0], np.float32)
  up = np.nextafter(x, np.float32(np.inf))
  got = ea.ulps(up.astype(np.float64), x.astype(np.float64))
  np.testing.assert_array_equal(got, [1.0, 1.0, 1.0])
  assert ea.ulps(np.float64(2.0), np.float64(2.0)) == 0.0


def test_every_function_is_measured_on_the_host():
  with jax.default_device(jax.devices("cpu")[0]):
    for name in ea.FUNCTIONS:
      row = ea.measure(name, n=1 << 14)
      assert 0.12 < row["max_ulp"] < 10.0, row
      assert 4e-9 < row["mean_abs_rel"] < 1.2e-7, row
      assert abs(row["mean_signed_rel"]) < row["mean_abs_rel"], row
    rows = ea.decay_product(lengths=(8, 64))
    ours = ea.decay_product(lengths=(8, 64), exp=gates.exp)
  assert [r["n"] for r in rows] == [8, 64] == [r["n"] for r in ours]
  assert all(0 < r["max_abs_rel"] < 1e-5 for r in rows + ours), (rows, ours)
