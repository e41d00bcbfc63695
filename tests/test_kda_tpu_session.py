"""The TPU session's plan runs end to end on a CPU (`--smoke`).

Its profiles run our kernels in interpret mode there at B1 T128 H16 K128:
a check that a step runs (each profile holds a summary, none an error),
that every step's implementations, precisions and packed rows exist, and
that a profile
which would start with too little of the budget left is skipped and
recorded, not run. No timing is asserted.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import kda_tpu
from benchmarks import kda_tpu_profile as profile
from benchmarks import kda_tpu_session

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *flags):
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.kda_tpu_session", "--smoke",
       f"--out={tmp_path}", f"--trace_dir={tmp_path / 'traces'}", *flags],
      cwd=REPO, capture_output=True, text=True, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "kda_tpu_session.json") as f:
    return json.load(f)["steps"]


@pytest.mark.slow
def test_smoke_profiles_a_step(tmp_path):
  steps = _run(tmp_path, "--steps=strided_rows", "--passes=fwd",
               "--budget_s=900")
  assert list(steps) == ["strided_rows"]
  assert set(steps["strided_rows"]["results"]) == {
      f"{impl}_fwd" for impl in ("batched_hb16_fused",
                                 "batched_strided_fused")}
  for key, r in steps["strided_rows"]["results"].items():
    assert "error" not in r and "skipped" not in r, (key, r)
    assert r["wall_ms_per_call"] and "ops" in r, key


def test_every_step_names_implementations_that_trace():
  # Every (implementation, precision, packed rows) of the plan builds a
  # function and traces under jit (shapes only, nothing run), so no step
  # fails on the chip for a name or a value read at trace time.
  ids = profile.documents(1, 128, 64)
  for name, _, dtype, impls, passes, docs in kda_tpu_session.steps():
    args = jax.eval_shape(lambda: kda_tpu.inputs(1, 128, 16, 128,
                                                 dtype=dtype))
    for impl, precision in impls:
      if impl == "tokamax_mosaic":
        continue  # tokamax's kernel traces only for a TPU
      for pass_name in passes:
        fn = profile.with_pass(profile.implementation(
            impl, ids if docs else None, profile.parse_precision(precision)),
                               pass_name)
        jax.eval_shape(jax.jit(fn), *args)


def test_a_spent_budget_skips_and_records_every_profile(tmp_path):
  steps = _run(tmp_path, "--steps=strided_pair_t2048,float32_t128",
               "--budget_s=1", "--reserve_s=60")
  keys = {k for s in steps.values() for k in s["results"]}
  assert keys == {"batched_hb16_fused_fwd_bwd",
                  "batched_strided_fused_fwd_bwd"} | {
      f"{impl}_{p}{at}" for impl, at in (("chunked", ""),
                                         ("batched_fused", "@high"))
      for p in ("fwd", "fwd_bwd")}
  assert all("skipped" in r for s in steps.values()
             for r in s["results"].values())
