r"""KDA at long context: time per token and memory from 1K to 64K tokens.

    .venv/bin/python -m benchmarks.kda_long_context \
        [--out=benchmarks/results/kda_long_context_cpu.json]

Two measurements, one process:

1. The op. For T = 1K .. 64K (B=1, H=4, K=V=64, f32, lower-bound gate -5,
   q/k L2 norm; `benchmarks.kda_speed`'s inputs), the forward and the
   forward+backward (gradients of every input) of our `chunked` backend,
   tokamax 0.0.17's `xla_chunked`, and softmax attention
   (`jax.nn.dot_product_attention`, causal, XLA) on the same q, k, v.
   Reported: median and best milliseconds over rounds (every round calls
   every implementation once, order rotating: `kda_speed.time_rounds`),
   microseconds per token (of the best round: this VM has slow spells of
   seconds that move a median of 5 by up to 2x, and a length's best round is
   the least disturbed), and the temporary memory XLA plans for the
   compiled computation (`memory_analysis().temp_size_in_bytes`;
   deterministic). `--warm_calls=1` times each call right after an untimed
   call of the same implementation, as a training loop runs it. An implementation whose plan exceeds `--max_temp_gib`
   is compiled but not run (its memory is still reported): softmax
   attention's [T, T] scores reach 256 GiB at 64K.
2. The crossover. The experiment model (configs/mqar.py: 2 layers, width
   128, 2 heads of dim 32) with a `kda` mixer and with an `attention` mixer,
   its whole jitted training step (model, loss, AdamW) at a fixed 8192
   tokens per step (batch 8192 / T) for T = 256 .. 8192: the shortest T at
   which KDA's step is faster than attention's (paired per round).

Outputs: the JSON, a Markdown table beside it (`.md`) and a log-log plot
(`.png`) of time per token and memory against T.
"""

import argparse
import json
import os
import platform
import statistics

import jax

from benchmarks import kda_speed
from experiments.tools import cli

LENGTHS = (1024, 4096, 16384, 65536)
SHAPE = dict(b=1, h=4, d=64)
TRAIN_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
TRAIN_TOKENS = 8192


def attention(q, k, v, g, beta, a_log, dt_bias):
  del g, beta, a_log, dt_bias  # same call signature as the KDA functions
  return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      implementation="xla")


IMPLS = {"ours_chunked": lambda: kda_speed.ours("chunked"),
         "tokamax_xla_chunked": lambda: kda_speed.tokamax_impl("xla_chunked"),
         "attention": lambda: attention}


def bench_op(lengths, repeats, max_temp_gib, warm_calls=0):
  rows = []
  for t in lengths:
    args = kda_speed.make_inputs(SHAPE["b"], t, SHAPE["h"], SHAPE["d"])
    for mode in ("forward", "forward+backward"):
      fns, mems = {}, {}
      for name, make in IMPLS.items():
        f = make()
        fn = jax.jit(f if mode == "forward" else kda_speed.fwd_bwd(f))
        mems[name] = kda_speed.temp_bytes(fn, args)
        if mems[name] is None or mems[name] <= max_temp_gib * 2**30:
          fns[name] = fn
      for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
      times = kda_speed.time_rounds(fns, args, repeats,
                                    warm_calls=warm_calls)
      for name in IMPLS:
        secs = statistics.median(times[name]) if name in times else None
        best = min(times[name]) if name in times else None
        rows.append(dict(
            t=t, mode=mode, impl=name,
            ms=None if secs is None else secs * 1e3,
            best_ms=None if best is None else best * 1e3,
            us_per_token=None if best is None else best / t * 1e6,
            ms_rounds=[s * 1e3 for s in times.get(name, [])],
            temp_mib=None if mems[name] is None else mems[name] / 2**20,
            ran=name in times))
      print(markdown_op([r for r in rows if r["t"] == t and
                         r["mode"] == mode]), flush=True)
  return rows


def bench_train(lengths, repeats, warm_calls=0):
  """ms per step of the MQAR model's train step, kda vs attention mixers."""
  # Imported here: the op benchmark does not need the experiment stack.
  from configs import common as config_lib  # pylint: disable=g-import-not-at-top
  from configs import mqar  # pylint: disable=g-import-not-at-top
  from experiments import tasks  # pylint: disable=g-import-not-at-top
  from experiments.training import train  # pylint: disable=g-import-not-at-top

  rows = []
  for t in lengths:
    fns, inputs = {}, {}
    for mixer in ("kda", "attention"):
      config = config_lib.apply_diff(mqar.get_config(), {
          "model.mixer": mixer, "task.seq_len": t,
          "train.batch_size": TRAIN_TOKENS // t})
      prog = train.build_program(config)
      batch = prog.task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0),
                               config.train.batch_size).as_dict()
      params = prog.init(jax.random.key(0), batch["inputs"][:1])
      inputs[mixer] = (params, prog.optimizer.init(params), batch)
      fns[mixer] = prog.train_step
      jax.block_until_ready(prog.train_step(*inputs[mixer]))  # compile
    extra = {m: (fns[m], inputs[m]) for m in fns}
    times = kda_speed.time_rounds({}, (), repeats, extra=extra,
                                  warm_calls=warm_calls)
    rows.append(dict(
        t=t, batch=TRAIN_TOKENS // t,
        kda_ms=statistics.median(times["kda"]) * 1e3,
        attention_ms=statistics.median(times["attention"]) * 1e3,
        attention_over_kda=kda_speed.paired(times["attention"],
                                            times["kda"])))
    print(markdown_train(rows[-1:]), flush=True)
  return rows


def crossover(train_rows):
  """Shortest T from which on KDA's step is faster (paired ratio > 1)."""
  best = None
  for r in sorted(train_rows, key=lambda r: r["t"], reverse=True):
    if r["attention_over_kda"] <= 1:
      break
    best = r["t"]
  return best


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def markdown_op(rows):
  lines = ["| T | pass | implementation | median ms | best ms |"
           " us / token (best) | temp MiB |",
           "|---:|---|---|---:|---:|---:|---:|"]
  for r in rows:
    ms = _fmt(r["ms"], ".1f") if r["ran"] else "not run (memory)"
    best = r.get("best_ms")
    if best is None and r["ms_rounds"]:
      best = min(r["ms_rounds"])
    us = None if best is None else best * 1e3 / r["t"]
    lines.append(f"| {r['t']:,} | {r['mode']} | {r['impl']} | {ms} |"
                 f" {_fmt(best, '.1f')} | {_fmt(us, '.2f')} |"
                 f" {_fmt(r['temp_mib'], ',.0f')} |")
  return "\n".join(lines)


def markdown_train(rows):
  lines = ["| T | batch | kda ms / step | attention ms / step |"
           " attention / kda (paired) |", "|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['t']:,} | {r['batch']} | {r['kda_ms']:.0f} |"
                 f" {r['attention_ms']:.0f} |"
                 f" {r['attention_over_kda']:.2f}x |")
  return "\n".join(lines)


def summary(op_rows):
  """The two long-context targets: per-token flatness and the memory ratio."""
  out = {}
  for mode in ("forward", "forward+backward"):
    ours = {r["t"]: r for r in op_rows
            if r["impl"] == "ours_chunked" and r["mode"] == mode}
    if not ours:
      continue
    per_token = [r["us_per_token"] for t, r in ours.items() if t >= 4096]
    if per_token:
      out[f"{mode} us/token max/min (T >= 4K)"] = (
          max(per_token) / min(per_token))
    t_max = max(ours)
    theirs = next((r for r in op_rows if r["impl"] == "tokamax_xla_chunked"
                   and r["mode"] == mode and r["t"] == t_max), None)
    if theirs and theirs["temp_mib"] and ours[t_max]["temp_mib"]:
      out[f"{mode} tokamax xla_chunked / ours temp memory at T={t_max}"] = (
          theirs["temp_mib"] / ours[t_max]["temp_mib"])
  return out


def plot(op_rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  styles = {"ours_chunked": "o-", "tokamax_xla_chunked": "s--",
            "attention": "^:"}
  for impl, style in styles.items():
    for mode, alpha in (("forward", 0.5), ("forward+backward", 1.0)):
      rs = sorted((r for r in op_rows
                   if r["impl"] == impl and r["mode"] == mode),
                  key=lambda r: r["t"])
      ran = [r for r in rs if r["ran"]]
      if ran:
        axes[0].plot([r["t"] for r in ran], [r["us_per_token"] for r in ran],
                     style, alpha=alpha, label=f"{impl}, {mode}")
      if mode == "forward+backward":
        mem = [r for r in rs if r["temp_mib"]]
        axes[1].plot([r["t"] for r in mem], [r["temp_mib"] for r in mem],
                     style, label=impl)
  for ax, label in ((axes[0], "microseconds per token"),
                    (axes[1], "temporary memory, forward+backward (MiB)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=7)
  axes[1].legend(fontsize=7)
  fig.suptitle("KDA vs softmax attention, B=1, H=4, K=V=64, f32")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _normalize(rows):
  """Per-token times from the best round (rows of older JSON: the median)."""
  for r in rows:
    if r["ms_rounds"]:
      r["best_ms"] = min(r["ms_rounds"])
      r["us_per_token"] = r["best_ms"] / r["t"] * 1e3
  return rows


def write_outputs(result, base):
  """`base`.md and `base`.png from a result (fresh or loaded)."""
  _normalize(result["op"])
  result["summary"] = summary(result["op"])
  train_lengths = result.get("train_step")
  plot(result["op"], base + ".png")
  with open(base + ".md", "w") as f:
    f.write(f"Machine: {result['machine']['platform']},"
            f" {result['machine']['cpu_count']} CPUs, f32 matmul"
            f" {result['matmul_gflops']:.0f} GFLOP/s (2048^3).")
    if result.get("warm_calls"):
      f.write(f" Each timed call after {result['warm_calls']} untimed"
              " call(s) of the same implementation (back to back).")
    f.write("\n\n")
    f.write(markdown_op(result["op"]) + "\n\n")
    for k, v in result["summary"].items():
      f.write(f"* {k}: {v:.2f}\n")
    if train_lengths:
      f.write("\nTraining step of the MQAR model, " f"{TRAIN_TOKENS} tokens"
              " per step:\n\n" + markdown_train(result["train_step"]) + "\n\n"
              f"Crossover (KDA's step faster from T on):"
              f" {result['crossover_t']}\n")
  print(f"wrote {base}.md, {base}.png", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=cli.positive_int, default=5)
  parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                      type=cli.positive_ints)
  parser.add_argument("--train_lengths",
                      default=",".join(map(str, TRAIN_LENGTHS)),
                      help="'' skips the training-step crossover")
  parser.add_argument("--max_temp_gib", type=float, default=8.0)
  parser.add_argument("--warm_calls", type=int, default=0,
                      help="untimed calls of the same implementation before"
                      " each timed one (`kda_speed.time_rounds`)")
  parser.add_argument("--out",
                      default="benchmarks/results/kda_long_context_cpu.json",
                      type=cli.output_path)
  parser.add_argument("--render", action="store_true",
                      help="only rewrite the .md and .png from --out's JSON")
  a = parser.parse_args()
  if a.render:
    with open(a.out) as f:
      result = json.load(f)
    write_outputs(result, os.path.splitext(a.out)[0])
    with open(a.out, "w") as f:  # the summary, recomputed
      json.dump(result, f, indent=1)
    return
  lengths = a.lengths
  train_lengths = [int(x) for x in a.train_lengths.split(",") if x]
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  result = dict(machine=dict(platform=platform.platform(),
                             cpu_count=os.cpu_count(),
                             device=str(jax.devices()[0]),
                             jax=jax.__version__),
                matmul_gflops=kda_speed.matmul_gflops(), shape=SHAPE,
                warm_calls=a.warm_calls)

  def save():  # after every piece, so an interrupted run keeps the rest
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)

  result["op"] = bench_op(lengths, a.repeats, a.max_temp_gib, a.warm_calls)
  result["summary"] = summary(result["op"])
  save()
  if train_lengths:
    result["train_step"] = bench_train(train_lengths, a.repeats,
                                       a.warm_calls)
    result["crossover_t"] = crossover(result["train_step"])
    save()
  write_outputs(result, os.path.splitext(a.out)[0])


if __name__ == "__main__":
  cli.run_script(main)
