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


def test_reads_each_programs_total_once(tmp_path):
  files = {"1796-jvp_jit__forward__.2-71-schedule-analysis_final_bundles.txt":
               9087,
           "1797-copy.2-65-schedule-analysis_final_bundles.txt": 1415,
           "1798-jvp_jit__forward__.2-70-final_bundles.txt": 5}
  for name, n in files.items():
    (tmp_path / name).write_text(ANALYSIS.format(n=n, m=n - 12))
  seen = set()
  assert bundles.schedules(str(tmp_path), seen) == {
      "jvp_jit__forward__.2": 9087, "copy.2": 1415}
  assert bundles.schedules(str(tmp_path), seen) == {}  # read already


def test_a_missing_libtpu_is_named(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.kda_kernel_bundles",
       f"--out={tmp_path}", f"--libtpu={tmp_path / 'libtpu.so'}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  assert "--libtpu: no file" in result.stderr
