r"""The kernel measurements still owed, in priority order, in one process.

    python -m benchmarks.kda_tpu_session --out=DIR --budget_s=480  # a TPU
    python -m benchmarks.kda_tpu_session --out=DIR --smoke          # any host

A chip session is short, so the measurements that decide something come
first, all in one process (JAX and the kernels imported and warmed once).
Each step profiles implementations of `benchmarks/kda_tpu_profile.py` at one
shape (device time per call from a `jax.profiler` trace, as that script
does); `DIR/kda_tpu_session.json` is rewritten after every profile, so a run
cut short keeps what it measured, and a profile that would start with less
than `--reserve_s` of the budget left is skipped and marked so. The traces
go to `--trace_dir` (a temporary folder by default), not to DIR.

Steps (docs/kernel.md, "Next"; bfloat16 and B1 H32 K128 unless named).
The sessions before decided the fused backward, float32's three passes,
`auto`'s class on a v5e, the strided kernels' classes, the grid step's
shape and the exponent factors (`kda_tpu_session_v5e.json`,
`kda_tpu_session_decisions_v5e.json`,
`kda_tpu_session_segment_states_v5e.json`,
`kda_tpu_session_split_grid_classes_v5e.json`,
`kda_tpu_session_strided_rows_v5e.json` in benchmarks/results); these are
the steps still owed:

1. `strided_rows`: B1 T8192 H32 again, both passes, strided against 16
   heads a step: the wall time of calls dispatched back to back
   (`pipelined_ms_per_call`, which every profile now records) against the
   waited-for call's, for the targets (docs/kernel.md: no gaps inside the
   program; the rest of a waited-for call's wall time is the host's round
   trip).
2. `chunk_states_one_pass`: the state after every 1024 and every 64
   tokens written from the kernels' one pass (`pallas_chunkstates`,
   `pallas_chunkstates64`; the pieces took 12.66 and 43.18 ms at 1024)
   against `chunked` at 64; step 1's strided pair, in the same process,
   is the floor (no states).
3. `float32_t8192`: float32 inputs, our kernels at HIGH against one pass
   (the 1.3x target; 1.56x and 1.70x before ccc91b0 split each operand
   that several products read once, `pallas_batched._Operand`). Steps 1
   and 3 are the first timings of the kernels of 16041ff (the exponents
   from local sums, the solve's inverse formed and applied once, zero rows
   left out of products: their schedules, `kda_kernel_bundles.py`, put
   them at 0.82-0.90 of the cycles of the kernels timed last; step 1's
   pair took 1.90 and 6.42 ms of device time then).
4. `strided_pair_t2048`, `strided_pair_t1024`: forward+backward, the
   strided kernels against 16 heads a step (both kernels run strided from
   T 4096 only, `pallas.STRIDED`, where they were timed faster).
5. `short_t64`: T 64 (one chunk), `chunked`, our kernels and tokamax's
   (`auto`'s bfloat16 class starts at T 128).
6. `float32_t128`: float32 at T 128, `chunked` at "auto" against our
   kernels at HIGH (the float32 class starts at T 256).
7. `chunk_states_t1024`: the state after every 64 tokens at T 1024, ours
   against `chunked` (`auto` takes bfloat16 chunk-boundary states on the
   kernels from 1024 tokens apart only, as the pieces were timed).

`--smoke` shrinks every shape to B1 T128 H16 K128 and runs one call per
profile: on a CPU the kernels run in interpret mode, a check of the script,
not a measurement.
"""

import argparse
import json
import os
import platform
import tempfile
import time
import traceback

import jax

from benchmarks import kda_error_vs_length
from benchmarks import kda_tpu
from benchmarks import kda_tpu_profile as profile
from experiments.tools import cli

def steps():
  """[(step, shape, dtype, [(impl, precision)], passes, documents)]."""
  both = ("fwd", "fwd_bwd")
  auto = lambda *impls: [(i, "auto") for i in impls]
  f32 = [("chunked", "auto"), ("batched_fused", "high"),
         ("batched_fused", "default")]
  return [
      ("strided_rows", (1, 8192, 32, 128), "bfloat16",
       auto("batched_hb16_fused", "batched_strided_fused"), both, 0),
      ("chunk_states_one_pass", (1, 8192, 32, 128), "bfloat16",
       auto("pallas_chunkstates", "pallas_chunkstates64",
            "chunked_chunkstates64"), both, 0),
      ("float32_t8192", (1, 8192, 32, 128), "float32", f32[1:], both, 0),
      ("strided_pair_t2048", (1, 2048, 32, 128), "bfloat16",
       auto("batched_hb16_fused", "batched_strided_fused"), ("fwd_bwd",), 0),
      ("strided_pair_t1024", (1, 1024, 32, 128), "bfloat16",
       auto("batched_hb16_fused", "batched_strided_fused"), ("fwd_bwd",), 0),
      ("short_t64", (1, 64, 32, 128), "bfloat16",
       auto("chunked", "batched_hb16_fused", "tokamax_mosaic"), both, 0),
      ("float32_t128", (1, 128, 32, 128), "float32", f32[:2], both, 0),
      ("chunk_states_t1024", (1, 1024, 32, 128), "bfloat16",
       auto("pallas_chunkstates64", "chunked_chunkstates64"), both, 0),
  ]


STEP_NAMES = tuple(s[0] for s in steps())


def _profile(impl, pass_name, precision, ids, args, logdir, calls):
  """One profile's summary, or its error (the run goes on)."""
  try:
    fn = profile.with_pass(profile.implementation(
        impl, ids, profile.parse_precision(precision)), pass_name)
    return profile.profile_one(fn, args, logdir, calls)
  except Exception as e:  # pylint: disable=broad-except
    return dict(error=repr(e)[:2000] + traceback.format_exc()[-3000:])


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="kda_tpu_session", type=cli.output_folder)
  p.add_argument("--budget_s", type=cli.positive_int, default=480,
                 help="seconds for the whole run")
  p.add_argument("--reserve_s", type=int, default=45,
                 help="no profile starts with less than this left")
  p.add_argument("--steps", default=",".join(STEP_NAMES),
                 help="a subset of the steps, in the order given")
  p.add_argument("--calls", type=cli.positive_int, default=3)
  p.add_argument("--passes", default="fwd,fwd_bwd",
                 help="of fwd, fwd_bwd: the passes a step runs, of its own")
  p.add_argument("--trace_dir", default=None)
  p.add_argument("--smoke", action="store_true",
                 help="B1 T128 H16 K128, one call a profile (a check)")
  a = p.parse_args()
  chosen = a.steps.split(",")
  unknown = [s for s in chosen if s not in STEP_NAMES]
  if unknown:
    p.error(f"--steps: unknown {unknown}; allowed: {', '.join(STEP_NAMES)}")
  chosen_passes = a.passes.split(",")
  if not set(chosen_passes) <= {"fwd", "fwd_bwd"}:
    p.error(f"--passes: of fwd, fwd_bwd; got {a.passes!r}")
  if a.reserve_s < 0:
    p.error(f"--reserve_s: 0 or more seconds; got {a.reserve_s}")
  plan = {s[0]: s for s in steps()}
  calls = 1 if a.smoke else a.calls
  trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="kda_tpu_session_")
  os.makedirs(a.out, exist_ok=True)
  path = os.path.join(a.out, "kda_tpu_session.json")
  start = time.monotonic()
  commit, dirty = kda_error_vs_length.git_commit()
  report = dict(meta=dict(
      device=str(jax.devices()[0].device_kind), jax=jax.__version__,
      host=platform.node(), commit=commit, dirty=dirty, calls=calls,
      smoke=a.smoke, budget_s=a.budget_s), steps={})
  for name in chosen:
    _, shape, dtype, impls, passes, docs = plan[name]
    if a.smoke:
      shape = (1, 128, 16, 128)
    args = kda_tpu.inputs(*shape, dtype=dtype)
    ids = profile.documents(shape[0], shape[1], docs) if docs else None
    step = report["steps"][name] = dict(shape=shape, dtype=dtype,
                                        documents=docs, results={})
    for impl, precision in impls:
      for pass_name in [x for x in passes if x in chosen_passes]:
        key = f"{impl}_{pass_name}" + (
            f"@{precision}" if precision != "auto" else "")
        left = a.budget_s - (time.monotonic() - start)
        if left < a.reserve_s:
          step["results"][key] = dict(skipped=f"{left:.0f} s of the budget"
                                      " left")
        else:
          step["results"][key] = _profile(
              impl, pass_name, precision, ids, args,
              os.path.join(trace_dir, name, key.replace("@", "_")), calls)
        report["meta"]["elapsed_s"] = round(time.monotonic() - start, 1)
        with open(path, "w") as fh:
          json.dump(report, fh, indent=1)
    del args
  for name, step in report["steps"].items():
    print(f"## {name} {step['shape']} {step['dtype']}")
    for key, r in step["results"].items():
      if "skipped" in r or "error" in r:
        what = r.get("skipped") or "error"
      else:
        what = (f"device busy {r['ops_busy_us_per_call'] / 1e3:.2f} ms,"
                f" wall {r['wall_ms_per_call']} ms, pipelined"
                f" {r.get('pipelined_ms_per_call')} ms")
      print(f"  {key}: {what}")


if __name__ == "__main__":
  cli.run_script(main)
