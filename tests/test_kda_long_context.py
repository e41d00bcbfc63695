"""The long-context benchmark's summaries (no timings are asserted)."""

from absl.testing import absltest

from benchmarks import kda_long_context


def _op_row(t, mode, impl, best_ms, temp_mib):
  return dict(t=t, mode=mode, impl=impl, ms=best_ms, best_ms=best_ms,
              us_per_token=best_ms / t * 1e3, ms_rounds=[best_ms],
              temp_mib=temp_mib, ran=True)


class LongContextTest(absltest.TestCase):

  def test_crossover_is_the_shortest_length_from_which_kda_stays_faster(self):
    ratios = {256: 0.9, 512: 1.1, 1024: 0.95, 2048: 1.5, 4096: 3.0}
    rows = [dict(t=t, attention_over_kda=r) for t, r in ratios.items()]
    # 512 is faster but 1024 is not: the crossover is where it stays faster.
    self.assertEqual(kda_long_context.crossover(rows), 2048)
    self.assertIsNone(kda_long_context.crossover(
        [dict(t=1024, attention_over_kda=0.5)]))

  def test_summary_reads_flatness_from_4k_and_memory_at_the_longest(self):
    rows = [
        _op_row(1024, "forward", "ours_chunked", 100.0, 1.0),  # ignored
        _op_row(4096, "forward", "ours_chunked", 40.96, 2.0),  # 10 us/token
        _op_row(16384, "forward", "ours_chunked", 196.608, 3.0),  # 12
        _op_row(16384, "forward", "tokamax_xla_chunked", 1.0, 30.0),
        _op_row(16384, "forward", "attention", 1.0, 300.0),
    ]
    out = kda_long_context.summary(rows)
    self.assertAlmostEqual(out["forward us/token max/min (T >= 4K)"], 1.2)
    self.assertAlmostEqual(
        out["forward tokamax xla_chunked / ours temp memory at T=16384"], 10.0)
    self.assertNotIn("forward+backward us/token max/min (T >= 4K)", out)


if __name__ == "__main__":
  absltest.main()
