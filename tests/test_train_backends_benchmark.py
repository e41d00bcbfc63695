"""The training-step benchmark runs end to end on a CPU (`--smoke`).

A model with K = V = 128 (our kernels' lanes) trains two steps with the
`chunked` backend and with `pallas` (interpret mode off a TPU), each
compiled and timed in the same process: the MQAR model, and the language
model, whose rows pack documents (segment_ids). No timing is asserted: the step
times must only be there.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small_corpus(folder):
  """A stand-in for the standard library: files of 8 to 24 bytes, so that
  every 32-byte row of the smoke config packs several documents."""
  rng = np.random.default_rng(0)
  for i in range(600):
    (folder / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
    (folder / f"pkg{i % 4}" / f"m{i}.py").write_bytes(
        bytes(rng.integers(32, 127, rng.integers(8, 25)).astype(np.uint8)))
  return folder


@pytest.mark.slow
@pytest.mark.parametrize("config", ["mqar:smoke", "text:smoke"])
def test_smoke_times_each_backend(tmp_path, config):
  out = tmp_path / "train_backends.json"
  task = []
  if config.startswith("text"):  # the language model: packed documents
    task = [f"--set=task.source_dir={_small_corpus(tmp_path / 'corpus')}",
            f"--set=task.cache_dir={tmp_path / 'cache'}"]
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.train_backends", *task,
       f"--config={config}", "--set=model.kda.head_dim=128",
       "--set=model.kda.chunk_size=16", "--backends=chunked,pallas",
       "--smoke", f"--out={out}"],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())["backends"]
  for backend in ("chunked", "pallas"):
    assert rows[backend]["median_step_ms"] > 0, rows
  assert rows["pallas"]["median_ratio_to_first"] > 0, rows
