"""`benchmarks/kda_kernel_bundles.py` off a TPU and without libtpu: its
reading of libtpu's schedule analyses and its refusal of a missing libtpu.
(Compiling needs libtpu: `make bundles`.)"""

import os
import subprocess
import sys

from benchmarks import kda_kernel_bundles as bundles

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ANALYSIS = """Schedule analysis:
\ttotal scheduled bundles:    {n}
\tempty scheduled bundles:    12
\tnon empty scheduled bundles: {m}
"""


UTILIZATION = """== CAPACTIY:
MXU, XLU, VALU, VSTORE, VSTORE:SPILL
    4     3     4     1     1
== UTILIZATION:
0 0 0 0 0
4 1 2 1 1
2 0 4 1 0
"""


def test_reads_each_programs_bundles_and_units_then_clears(tmp_path):
  files = {"1796-jvp_jit__forward__.2-71-schedule-analysis_final_bundles.txt":
               ANALYSIS.format(n=9087, m=9075),
           "1796-jvp_jit__forward__.2-70-final_hlo-static-per-bundle-"
           "utilization.txt": UTILIZATION,
           "1797-copy.2-65-schedule-analysis_final_bundles.txt":
               ANALYSIS.format(n=1415, m=1403),
           "1798-jvp_jit__forward__.2-72-final_bundles.txt": "bundles"}
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  assert bundles.drain(str(tmp_path)) == {
      "jvp_jit__forward__.2": (9087, {"MXU": (4, 6), "XLU": (3, 1),
                                      "VALU": (4, 6), "VSTORE": (1, 2),
                                      "VSTORE:SPILL": (1, 1)}),
      "copy.2": (1415, {})}
  assert not list(tmp_path.iterdir())  # the next compile starts clean


def test_a_missing_libtpu_is_named(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.kda_kernel_bundles",
       f"--out={tmp_path}", f"--libtpu={tmp_path / 'libtpu.so'}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  assert "--libtpu: no file" in result.stderr
