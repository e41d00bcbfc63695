"""The TPU benchmark's kernel phase runs end to end on a CPU (`--smoke`).

Our Pallas forward runs in interpret mode there; the rows must hold its and
`chunked`'s errors against the float64 token scan (float32 at HIGHEST is
exact-product arithmetic on a CPU: within 1e-5) and a time per variant (no
timing is asserted). The phase is what a chip session runs first.
"""

import argparse
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_kernel_phase_smoke_writes_errors_and_times(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.kda_tpu", "--phase=kernel",
       "--smoke", "--repeats=1", f"--out={tmp_path}"],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "kda_tpu_kernel.json") as f:
    rows = json.load(f)["rows"]
  accuracy = [r for r in rows if r["part"] == "accuracy"]
  assert {(r["impl"], r["setting"]) for r in accuracy} == {
      (i, s) for i in ("kernel", "chunked") for s in ("highest", "default")}
  for r in accuracy:
    assert "error" not in r, r
    if r["setting"] == "highest":
      assert r["errors"]["o"] <= 1e-5 and r["errors"]["state"] <= 1e-5, r
  times = [r for r in rows if r["part"] == "time"]
  assert {(r["impl"], r["mode"]) for r in times} == {
      (i, m) for i in ("chunked", "kernel_hb1", "kernel_hb2", "kernel_hb4")
      for m in ("forward", "forward+backward")}
  assert all(r["ms"] > 0 for r in times), times


def test_table_takes_shapes_and_dtypes():
  # A chip session runs the table a piece at a time (one shape, one dtype).
  from benchmarks import kda_tpu  # pylint: disable=g-import-not-at-top
  assert kda_tpu._shapes("8,4096,16,128;1,1024,32,128") == [
      (8, 4096, 16, 128), (1, 1024, 32, 128)]
  assert kda_tpu._dtypes("float32") == ["float32"]
  for parse, text in ((kda_tpu._shapes, "1,2,3"), (kda_tpu._shapes, "1,0,2,2"),
                      (kda_tpu._dtypes, "float16")):
    with pytest.raises(argparse.ArgumentTypeError):
      parse(text)
