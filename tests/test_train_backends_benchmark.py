"""The training-step benchmark runs end to end on a CPU (`--smoke`).

A model with K = V = 128 (our kernels' lanes) trains two steps with the
`chunked` backend and with `pallas` (interpret mode off a TPU), each
compiled and timed in the same process. No timing is asserted: the step
times must only be there.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_smoke_times_each_backend(tmp_path):
  out = tmp_path / "train_backends.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.train_backends",
       "--config=mqar:smoke", "--set=model.kda.head_dim=128",
       "--set=model.kda.chunk_size=16", "--backends=chunked,pallas",
       "--smoke", f"--out={out}"],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())["backends"]
  for backend in ("chunked", "pallas"):
    assert rows[backend]["median_step_ms"] > 0, rows
  assert rows["pallas"]["median_ratio_to_first"] > 0, rows
