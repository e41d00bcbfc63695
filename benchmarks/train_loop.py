r"""The training loop's host work: a sync every step against every N steps.

    .venv/bin/python -m benchmarks.train_loop [--steps=20] [--rounds=3] \
        [--out=benchmarks/results/train_loop_cpu.json]

On the Kimi synthetic suite's Stack cell at T = 1024 (batch 8, the sweep's
model) for `kda`, `attention` and `none`, it times the steps of two loops
over the same jitted step and the same batches:

* `sync`: draw the batch in NumPy, run the step, fetch its metrics
  (`jax.device_get`), as the loop did before: the host waits for every
  step, and the device for every batch;
* `async`: the loop of `experiments.training.train` now: batches drawn in a
  thread (`train.Prefetch`) while the step before runs, metrics fetched every
  `--log_every` steps.

Also timed alone: drawing one batch, and one `jax.device_get` of a step's
metrics. Rounds alternate the two loops, and the ratio is taken within a
round (paired), so the machine's slow spells hit both alike. Report the
machine (its 2048^3 f32 matmul rate is printed) beside the numbers.
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from configs import common as config_lib
from configs.sweeps import kimi_synthetic
from experiments.sweeps import sweep_lib
from experiments.tools import cli
from experiments.training import train


def _config(mixer):
  """The sweep's seed-0 Stack T=1024 run of KDA with `mixer` swapped in."""
  sweep = kimi_synthetic.get_config()
  (run,) = [r for r in sweep_lib.expand(sweep)
            if r.name.startswith("stack_T1024/kda_seed0_")]
  return config_lib.apply_diff(run.config, {"model.mixer": mixer})


def _matmul_gflops():
  a = jnp.ones((2048, 2048), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(5):
    f(a).block_until_ready()
  return 5 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9


def _sync_loop(prog, params, opt, batch_fn, steps):
  t = time.perf_counter()
  for step in range(steps):
    params, opt, m = prog.train_step(params, opt,
                                     prog.put_batch(batch_fn(step)))
    jax.device_get(m)
  return (time.perf_counter() - t) / steps, params, opt


def _async_loop(prog, params, opt, batch_fn, steps, log_every):
  t = time.perf_counter()
  batches = train.Prefetch(batch_fn, 0, steps)
  for step in range(steps):
    params, opt, m = prog.train_step(params, opt,
                                     prog.put_batch(batches.get(step)))
    if (step + 1) % log_every == 0 or step + 1 == steps:
      jax.device_get(m)
  batches.close()
  return (time.perf_counter() - t) / steps, params, opt


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=cli.positive_int, default=20)
  parser.add_argument("--rounds", type=cli.positive_int, default=3)
  parser.add_argument("--log_every", type=cli.positive_int, default=10)
  parser.add_argument("--mixers", default="kda,attention,none")
  parser.add_argument("--out", default=None, type=cli.output_path)
  args = parser.parse_args()
  # Every mixer's config checked before any is timed: a bad name is refused
  # at once, not after the minutes the mixers before it take.
  configs = {mixer: _config(mixer) for mixer in args.mixers.split(",")}
  for config in configs.values():
    train.validate_config(config)
  rows = []
  for mixer, config in configs.items():
    prog = train.build_program(config)
    batch_fn = train.train_batches(config, prog.task)
    params = prog.init(jax.random.key(0),
                       jnp.zeros((1, config.task.seq_len), jnp.int32))
    opt = prog.init_opt(params)
    _, params, opt = _sync_loop(prog, params, opt, batch_fn, 2)  # compile
    draw = []
    for step in range(10):
      t = time.perf_counter()
      batch_fn(step)
      draw.append(time.perf_counter() - t)
    _, _, m = prog.train_step(params, opt, prog.put_batch(batch_fn(0)))
    jax.block_until_ready(m)
    t = time.perf_counter()
    jax.device_get(m)
    fetch = time.perf_counter() - t
    sync, fast, ratio = [], [], []
    for _ in range(args.rounds):
      s, params, opt = _sync_loop(prog, params, opt, batch_fn, args.steps)
      a, params, opt = _async_loop(prog, params, opt, batch_fn, args.steps,
                                   args.log_every)
      sync.append(s)
      fast.append(a)
      ratio.append(s / a)
    row = dict(mixer=mixer, batch_ms=1e3 * statistics.median(draw),
               fetch_ms=1e3 * fetch,
               sync_step_ms=1e3 * statistics.median(sync),
               async_step_ms=1e3 * statistics.median(fast),
               sync_over_async=statistics.median(ratio))
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = dict(machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                          matmul_gflops=_matmul_gflops()),
             steps=args.steps, rounds=args.rounds, log_every=args.log_every,
             rows=rows)
  print(json.dumps(out["machine"]))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  cli.run_script(main)
