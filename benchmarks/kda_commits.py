r"""KDA forward at several commits, paired in one process against tokamax.

    .venv/bin/python -m benchmarks.kda_commits --commits=fd22091,b1a82c4,HEAD

Did a change make the chunked forward slower? Timings of separate processes
on a shared VM move by up to 2x, so every version is timed in the same
process, in the same rounds: each commit's `linear_attention/` is extracted
with `git archive` into a temporary folder under a package name of its own
(`la_<commit>`, its absolute imports rewritten to that name), so the
versions import side by side. Every round calls each version's jitted
forward and tokamax's best forward (`xla`, its token scan) once, in an order
that rotates each round (`benchmarks.kda_speed.time_rounds`); the ratio
tokamax / version is the median over rounds of the ratio within a round.
Each version's output is checked against the working tree's.

The default shape is the held-out check's: B1 T4096 H4 K=V=64, float32,
fused lower-bound gate (-5), q/k L2 norm, no segments.

`--spinners=N` keeps N other processes spinning on the CPU while the rounds
run: a 2-core machine whose second core is busy (a test run, a neighbour on
the host). XLA:CPU splits our forward's operations over both cores and waits
for the slower half; tokamax's `xla` is a token scan on one thread, so the
ratio measures how much of our lead needs the second core.
"""

import argparse
import importlib
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

import jax
import numpy as np

from benchmarks import kda_speed
from experiments.tools import cli
from linear_attention import testing

PACKAGE = "linear_attention"


def extract(commit, root):
  """Imports `linear_attention` as of `commit`; returns (name, its ops)."""
  sha = subprocess.run(["git", "rev-parse", "--short", commit], check=True,
                       capture_output=True, text=True).stdout.strip()
  name = f"la_{sha}"
  archive = subprocess.run(["git", "archive", sha, PACKAGE], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
  os.rename(os.path.join(root, PACKAGE), os.path.join(root, name))
  pattern = re.compile(rf"\b{PACKAGE}\b")
  for folder, _, files in os.walk(os.path.join(root, name)):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        with open(path) as fh:
          text = fh.read()
        with open(path, "w") as fh:
          fh.write(pattern.sub(name, text))
  return sha, importlib.import_module(f"{name}.ops")


@contextlib.contextmanager
def spinning(n):
  """n child processes that spin on the CPU until the block ends."""
  procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
           for _ in range(n)]
  try:
    yield
  finally:
    for p in procs:
      p.kill()
      p.wait()


def forward(ops):
  def f(q, k, v, g, beta, a_log, dt_bias):
    o, _ = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_gate_in_kernel=True, use_qk_l2norm=True, backend="chunked")
    return o
  return jax.jit(f)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--commits", required=True,
                      help="comma-separated commits (HEAD, hashes, tags)")
  parser.add_argument("--shape", default="1x4096x4x64", help="BxTxHxK")
  parser.add_argument("--repeats", type=cli.positive_int, default=21)
  parser.add_argument("--warm_calls", type=int, default=1,
                      help="untimed calls before each timed one (back to"
                      " back, as a training loop runs; see kda_speed)")
  parser.add_argument("--spinners", type=int, default=0,
                      help="processes kept spinning while the rounds run")
  parser.add_argument("--out", default="benchmarks/results/kda_commits_cpu.json",
                      type=cli.output_path)
  a = parser.parse_args()
  b, t, h, d = (int(x) for x in a.shape.split("x"))
  args = kda_speed.make_inputs(b, t, h, d)
  root = tempfile.mkdtemp(prefix="kda_commits_")
  sys.path.insert(0, root)
  fns = {}
  for commit in a.commits.split(","):
    sha, ops = extract(commit, root)
    fns[sha] = forward(ops)
  fns["tokamax_xla"] = jax.jit(kda_speed.tokamax_impl("xla"))
  outs = {n: np.asarray(jax.block_until_ready(f(*args)), np.float32)
          for n, f in fns.items()}
  want = np.asarray(kda_speed.ours("chunked")(*args), np.float32)
  errors = {n: testing.relative_l2_error(o, want) for n, o in outs.items()}
  mm = kda_speed.matmul_call()
  with spinning(a.spinners):
    times = kda_speed.time_rounds(fns, args, a.repeats, extra={"mm": mm},
                                  warm_calls=a.warm_calls)
  mm_rate = 2 * kda_speed.MATMUL_N ** 3 / min(times["mm"]) / 1e9
  rows = []
  for n in fns:
    rows.append(dict(
        version=n, ms=statistics.median(times[n]) * 1e3,
        tokamax_over_this=kda_speed.paired(times["tokamax_xla"], times[n]),
        ms_rounds=[x * 1e3 for x in times[n]], rel_err_vs_worktree=errors[n]))
  head = (f"f32 matmul {mm_rate:.0f} GFLOP/s (2048^3, best round);"
          f" {a.warm_calls} warm call(s); {a.spinners} spinning process(es)")
  lines = [head, "", "| version | forward ms (median) | tokamax xla / this"
           " (paired median) | rel. err vs working tree |", "|---|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['version']} | {r['ms']:.1f} |"
                 f" {r['tokamax_over_this']:.2f}x | {r['rel_err_vs_worktree']:.1e} |")
  print("\n".join(lines), flush=True)
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(dict(machine=dict(platform=platform.platform(),
                                cpu_count=os.cpu_count(),
                                device=str(jax.devices()[0]),
                                jax=jax.__version__),
                   shape=[b, t, h, d], repeats=a.repeats,
                   warm_calls=a.warm_calls, spinners=a.spinners,
                   matmul_gflops=mm_rate,
                   rows=rows), f, indent=1)


if __name__ == "__main__":
  cli.run_script(main)
