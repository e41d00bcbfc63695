r"""KDA speed: our backends against tokamax's XLA implementations, one process.

    .venv/bin/python -m benchmarks.kda_speed [--out=benchmarks/results/kda_speed_cpu.json]

For each shape (B, T, H, K=V) it times the forward and the forward+backward
(gradients of every input) of our `reference` (short sequences only) and
`chunked` backends and tokamax 0.0.17's `xla_chunked` and `xla`, on the same
inputs: f32, lower-bound gate fused in the op (-5), q/k L2 norm. Timing is
plain JAX: compile, warm up, then `--repeats` rounds; each round calls every
implementation once and a 2048^3 f32 matmul, in an order that rotates every
round so that cold caches hit all of them alike.

Reported per row: median milliseconds; the ratio of tokamax's time to ours
(> 1 means we are faster) as the median over rounds of the ratio within a
round (this VM has slow spells of seconds, up to 2x; calls of one round share
them, so a paired ratio moves less than a ratio of two medians, though it
still moves between runs);
achieved GFLOP/s by the Kimi Linear FLOP count (arXiv 2510.26692 Eq. 13:
6 T d^2 + 3 T C d + T C^2 per head for the forward, C = 64; the
forward+backward is counted as 3x that) and its fraction of the matmul's
rate, paired the same way; and the peak
temporary memory XLA's compiler plans for the computation
(`compiled.memory_analysis()`; deterministic, unlike a timing).

`--warm_calls=1` times each call right after an untimed call of the same
implementation (back to back, as a training loop runs it); without it a
call may start with XLA:CPU's second thread asleep, which costs our forward
up to 2x (docs/performance.md).

Outputs of every implementation are checked against ours (relative L2) and
the check is printed, so a fast wrong path cannot hide.

`--shapes` also takes peers' benchmark names (`NAMED_SHAPES`: tokamax's
`fixed_training_b1_t8192_bf16`, `packed_training_b1_t8192_n25_bf16` and
fla's `B1_T8192_H96_D128` style), bf16 and, for the packed one, 25 documents
of random lengths, so their tables can be set beside ours; `--impls` picks
implementations, and one whose compiled plan exceeds `--max_temp_gib` is
reported but not run.

First, `--train_step=mqar` (default; `none` skips it) times the default
experiment's whole jitted training step (model, loss, AdamW update) with
each KDA backend and reports steps/s and tokens/s.
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.tools import cli
from linear_attention import ops
from linear_attention import testing

SHAPES = ((1, 4096, 4, 64), (1, 1024, 4, 64), (2, 2048, 8, 128))
# Shapes by the names peers give them, so their tables can be set beside
# ours: (B, T, H, K=V), dtype, number of packed segments (None: unpacked).
# tokamax's KDA benchmark names; fla's `B{B}_T{T}_H{H}_D{D}` style.
NAMED_SHAPES = {
    "fixed_training_b1_t8192_bf16": ((1, 8192, 32, 128), "bfloat16", None),
    "packed_training_b1_t8192_n25_bf16": ((1, 8192, 32, 128), "bfloat16",
                                          25),
    "B1_T8192_H96_D128": ((1, 8192, 96, 128), "bfloat16", None),
}
REFERENCE_MAX_T = 1024
CHUNK = 64


def kda_flops(b, t, h, d, c=CHUNK):
  """Forward FLOPs by Kimi Linear Eq. 13, summed over heads and batch."""
  return b * h * (6 * t * d * d + 3 * t * c * d + t * c * c)


def segment_ids(b, t, n, seed=0):
  """[B, T] int32: `n` documents of random lengths (>= 1) per row, packed."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((b, t), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t), n - 1, replace=False))
    ids[row] = np.repeat(np.arange(1, n + 1), np.diff([0, *cuts, t]))
  return jnp.asarray(ids)


def make_inputs(b, t, h, d, seed=0, dtype="float32"):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, t, h, d))
  v = jax.random.normal(ks[2], (b, t, h, d))
  g = jax.random.normal(ks[3], (b, t, h, d))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  a_log = jnp.log(jax.random.uniform(ks[5], (h,), minval=1, maxval=16))
  dt_bias = jnp.zeros((h * d,))
  cast = lambda x: x.astype(dtype)
  return (cast(q), cast(k), cast(v), cast(g), cast(beta), a_log, dt_bias)


def ours(backend, segments=None):
  """f(q, k, v, g, beta, a_log, dt_bias[, segment_ids]) -> o."""
  def f(q, k, v, g, beta, a_log, dt_bias, ids=None):
    o, _ = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_gate_in_kernel=True, use_qk_l2norm=True, backend=backend,
        segment_ids=ids, max_num_segments=segments)
    return o
  return f


def tokamax_impl(implementation, segments=None):
  import tokamax  # pylint: disable=g-import-not-at-top

  def f(q, k, v, g, beta, a_log, dt_bias, ids=None):
    hf = lambda x: jnp.moveaxis(x, 2, 0)
    o, _ = tokamax.ops.kimi_delta_attention(
        hf(q), hf(k), hf(v), hf(g), jnp.moveaxis(beta, 2, 0), a_log=a_log,
        delta_time_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.0,
        use_qk_l2norm=True, implementation=implementation, segment_ids=ids,
        max_num_segments=segments)
    return jnp.moveaxis(o, 0, 2)
  return f


def fwd_bwd(f):
  def loss(*args):
    o = f(*args)
    return jnp.sum(o * jnp.cos(o))  # a cotangent that depends on o
  return jax.grad(loss, argnums=tuple(range(7)))


def time_rounds(fns, args, repeats, extra=None, warm_calls=0):
  """Seconds per call of each jitted fn, one list entry per round.

  Every round calls each fn once (and each `extra` (fn, args) pair), in an
  order that rotates every round: on the 2-core dev machine the call that
  follows a large one (say tokamax `xla`'s backward, 1 GiB of temporaries)
  ran a KDA forward up to 1.8x slower, so no implementation may always take
  that place.

  `warm_calls` untimed calls of the same fn precede each timed one, so it is
  timed the way a training loop runs it, back to back. Without them a call
  may start with XLA:CPU's second worker thread asleep (after an idle spell
  or a long single-threaded call): our forward, a chain of small operations
  handed between threads, then takes up to 2x as long (docs/performance.md,
  "Why the forward's time is bimodal").
  """
  calls = {name: (fn, args) for name, fn in fns.items()}
  calls.update(extra or {})
  times = {name: [] for name in calls}
  names = list(calls)
  for r in range(repeats):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      fn, fn_args = calls[name]
      for _ in range(warm_calls):
        jax.block_until_ready(fn(*fn_args))
      start = time.perf_counter()
      jax.block_until_ready(fn(*fn_args))
      times[name].append(time.perf_counter() - start)
  return times


def time_many(fns, args, repeats, warm_calls=0):
  """Median seconds per call of each jitted fn, interleaved (`time_rounds`)."""
  return {name: statistics.median(ts) for name, ts in time_rounds(
      fns, args, repeats, warm_calls=warm_calls).items()}


def paired(numerator, denominator):
  """Median over rounds of numerator[r] / denominator[r].

  Both timed in the same round, seconds apart: this VM's slow spells (a
  whole round at up to 2x) mostly cancel in the ratio instead of deciding a
  median taken per implementation.
  """
  return statistics.median(a / b for a, b in zip(numerator, denominator))


MATMUL_N = 2048


def matmul_call(n=MATMUL_N):
  """(jitted f32 n^3 matmul, its args), compiled."""
  a = jax.random.normal(jax.random.key(1), (n, n))
  f = jax.jit(lambda x: x @ x)
  jax.block_until_ready(f(a))
  return f, (a,)


def matmul_gflops(n=MATMUL_N, repeats=5):
  f, a = matmul_call(n)
  best = min(time_rounds({"mm": f}, a, repeats)["mm"])
  return 2 * n ** 3 / best / 1e9


def temp_bytes(fn, args):
  compiled = fn.lower(*args).compile()
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def bench_shape(shape, repeats, dtype="float32", segments=None,
                impls=("ours_chunked", "tokamax_xla_chunked", "tokamax_xla",
                       "ours_reference"), shape_name=None,
                modes=("forward", "forward+backward"), max_temp_gib=8.0,
                warm_calls=0):
  b, t, h, d = shape
  args = make_inputs(b, t, h, d, dtype=dtype)
  if segments:
    args = (*args, segment_ids(b, t, segments))
  makers = {"ours_chunked": lambda: ours("chunked", segments),
            "tokamax_xla_chunked": lambda: tokamax_impl("xla_chunked",
                                                        segments),
            "tokamax_xla": lambda: tokamax_impl("xla", segments),
            "ours_reference": lambda: ours("reference", segments)}
  impls = {n: makers[n]() for n in impls
           if n != "ours_reference" or t <= REFERENCE_MAX_T}
  rows = []
  for mode in modes:
    fns = {n: jax.jit(f if mode == "forward" else fwd_bwd(f))
           for n, f in impls.items()}
    mems = {n: temp_bytes(fn, args) for n, fn in fns.items()}
    for n, mem in mems.items():  # compiled, not run: reported, no row
      if n != "ours_chunked" and mem is not None and mem > max_temp_gib * 2**30:
        print(f"{n} {mode}: XLA plans {mem / 2**30:.1f} GiB of temporaries,"
              f" over --max_temp_gib={max_temp_gib}; not run", flush=True)
        del fns[n]
    outs = {n: jax.block_until_ready(fn(*args)) for n, fn in fns.items()}
    # The matmul runs in every round too: its rate is paired like the ratios.
    times = time_rounds(fns, args, repeats, extra={"mm": matmul_call()},
                        warm_calls=warm_calls)
    secs = {n: statistics.median(ts) for n, ts in times.items()}
    flops = kda_flops(b, t, h, d) * (1 if mode == "forward" else 3)
    theirs = [times[n] for n in ("tokamax_xla_chunked", "tokamax_xla")
              if n in times]
    best_tokamax = [min(xs) for xs in zip(*theirs)] if theirs else None
    mm_seconds_per_flop = [ts / (2 * MATMUL_N ** 3) for ts in times["mm"]]
    for name in fns:
      err = testing.relative_l2_error(
          np.concatenate([np.ravel(x).astype(np.float32)
                          for x in jax.tree.leaves(outs[name])]),
          np.concatenate([np.ravel(x).astype(np.float32)
                          for x in jax.tree.leaves(outs["ours_chunked"])]))
      rows.append(dict(
          shape=shape, name=shape_name, dtype=dtype, segments=segments,
          mode=mode, impl=name, ms=secs[name] * 1e3,
          ms_rounds=[ts * 1e3 for ts in times[name]],
          speedup_vs_tokamax_xla_chunked=paired(
              times["tokamax_xla_chunked"], times[name])
          if "tokamax_xla_chunked" in times else None,
          speedup_vs_best_tokamax=None if best_tokamax is None
          else paired(best_tokamax, times[name]),
          gflops=flops / secs[name] / 1e9,
          # achieved rate / matmul rate, per round
          matmul_fraction=paired(
              [flops * m for m in mm_seconds_per_flop], times[name]),
          matmul_gflops=2 * MATMUL_N ** 3 / secs["mm"] / 1e9,
          temp_mib=None if mems[name] is None else mems[name] / 2**20,
          rel_err_vs_ours_chunked=err, warm_calls=warm_calls))
  return rows


def bench_train_step(repeats, config_name="mqar", warm_calls=0):
  """Steps/s and tokens/s of the default experiment's jitted training step.

  The config file's own model, batch and sequence length (configs/mqar.py:
  2 layers, B=32, T=256), once per KDA backend; the same batch and parameters
  for each, interleaved like the op timings.
  """
  # Imported here: the op benchmark does not need the experiment stack.
  from configs import common as config_lib  # pylint: disable=g-import-not-at-top
  from configs import delayed_copy, mqar  # pylint: disable=g-import-not-at-top
  from experiments import tasks  # pylint: disable=g-import-not-at-top
  from experiments.training import train  # pylint: disable=g-import-not-at-top

  base = {"mqar": mqar, "delayed_copy": delayed_copy}[config_name].get_config()
  fns, inputs = {}, None
  for backend in ("chunked", "reference"):
    config = config_lib.apply_diff(base, {"model.kda.backend": backend})
    prog = train.build_program(config)
    if inputs is None:
      batch = prog.task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0),
                               config.train.batch_size).as_dict()
      params = prog.init(jax.random.key(0), batch["inputs"][:1])
      inputs = (params, prog.optimizer.init(params), batch)
    fns[backend] = prog.train_step
    jax.block_until_ready(prog.train_step(*inputs))  # compile
  secs = time_many(fns, inputs, repeats, warm_calls)
  tokens = base.train.batch_size * base.task.seq_len
  return [dict(config=config_name, backend=name, ms=s * 1e3,
               steps_per_second=1 / s, tokens_per_second=tokens / s)
          for name, s in secs.items()]


def markdown_train(rows):
  lines = ["| config | KDA backend | ms / step | steps/s | tokens/s |",
           "|---|---|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['config']} | {r['backend']} | {r['ms']:.0f} |"
                 f" {r['steps_per_second']:.2f} | {r['tokens_per_second']:.0f} |")
  return "\n".join(lines)


def markdown(rows, mm_rate):
  lines = [
      f"f32 matmul rate (2048^3, same process, best of 5): {mm_rate:.0f}"
      " GFLOP/s; ratios and `% matmul` are medians of per-round ratios"
      + "".join(sorted({f"; each timed call after {r['warm_calls']} untimed"
                        " call(s) of the same implementation"
                        for r in rows if r.get("warm_calls")})),
      "",
      "| B, T, H, K | pass | implementation | ms | tokamax xla_chunked / this"
      " | best tokamax / this | GFLOP/s | % matmul | temp MiB | rel. err vs"
      " chunked |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  ratio = lambda x: "-" if x is None else f"{x:.2f}x"
  for r in rows:
    mem = "n/a" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
    shape = ", ".join(map(str, r["shape"]))
    if r.get("name"):
      shape = f"{r['name']} ({shape})"
    elif r.get("dtype", "float32") != "float32":
      shape += f" {r['dtype']}"
    lines.append(
        f"| {shape} | {r['mode']} | {r['impl']} |"
        f" {r['ms']:.1f} | {ratio(r['speedup_vs_tokamax_xla_chunked'])} |"
        f" {ratio(r['speedup_vs_best_tokamax'])} | {r['gflops']:.1f} |"
        f" {100 * r['matmul_fraction']:.1f}% | {mem} |"
        f" {r['rel_err_vs_ours_chunked']:.1e} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=cli.positive_int, default=7)
  parser.add_argument("--shapes", default="all",
                      help="'all', e.g. '1x4096x4x64,1x1024x4x64', or names"
                      f" of peers' shapes: {', '.join(NAMED_SHAPES)}")
  parser.add_argument("--impls", default="all",
                      help="'all' or a subset of ours_chunked,"
                      "tokamax_xla_chunked,tokamax_xla,ours_reference"
                      " (tokamax's token scan `xla` takes minutes per call"
                      " at the named shapes on a CPU)")
  parser.add_argument("--modes", default="forward,forward+backward")
  parser.add_argument("--max_temp_gib", type=float, default=8.0,
                      help="a peer whose compiled plan needs more temporary"
                      " memory is reported and not run")
  parser.add_argument("--warm_calls", type=int, default=0,
                      help="untimed calls of the same implementation before"
                      " each timed one (back to back, as in a training"
                      " loop); 0 times each call between the others'")
  parser.add_argument("--out", default="benchmarks/results/kda_speed_cpu.json",
                      type=cli.output_path)
  parser.add_argument("--train_step", default="mqar",
                      help="config whose training step is timed per backend"
                      " ('mqar', 'delayed_copy' or 'none')")
  a = parser.parse_args()
  shapes = SHAPES if a.shapes == "all" else a.shapes.split(",")
  impls = ("ours_chunked", "tokamax_xla_chunked", "tokamax_xla",
           "ours_reference")
  if a.impls != "all":
    impls = tuple(a.impls.split(","))
    if "ours_chunked" not in impls:
      parser.error("--impls must include ours_chunked (the outputs are"
                   " checked against it)")
  plan = []  # (dims, keywords) per shape, read before any work starts
  for shape in shapes:
    if isinstance(shape, str) and shape in NAMED_SHAPES:
      dims, dtype, segments = NAMED_SHAPES[shape]
      plan.append((dims, dict(dtype=dtype, segments=segments,
                              shape_name=shape)))
    elif isinstance(shape, tuple):
      plan.append((shape, {}))
    else:
      try:
        dims = tuple(cli.positive_int(x) for x in shape.split("x"))
      except argparse.ArgumentTypeError:
        dims = ()
      if len(dims) != 4:
        parser.error(f"--shapes: {shape!r} is neither BxTxHxK (positive"
                     f" ints) nor one of {', '.join(NAMED_SHAPES)}")
      plan.append((dims, {}))
  mm_rate = matmul_gflops()
  rows, train_rows = [], []
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)

  def save():  # after every piece, so an interrupted run keeps the rest
    with open(a.out, "w") as f:
      json.dump(dict(machine=dict(platform=platform.platform(),
                                  cpu_count=os.cpu_count(),
                                  device=str(jax.devices()[0]),
                                  jax=jax.__version__),
                     matmul_gflops=mm_rate, rows=rows,
                     train_step=train_rows), f, indent=1)
    print(f"\nwrote {a.out}", flush=True)

  if a.train_step != "none":
    train_rows = bench_train_step(a.repeats, a.train_step, a.warm_calls)
    print(markdown_train(train_rows), flush=True)
    save()
  for dims, kw in plan:
    rows += bench_shape(dims, a.repeats, impls=impls,
                        modes=tuple(a.modes.split(",")),
                        max_temp_gib=a.max_temp_gib,
                        warm_calls=a.warm_calls, **kw)
    print(markdown(rows, mm_rate), flush=True)
    save()


if __name__ == "__main__":
  cli.run_script(main)
