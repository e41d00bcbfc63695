r"""Training steps per second of one model with each KDA backend.

    python -m benchmarks.train_backends --config=mqar:tpu --set=mesh.data=1 \
        --set=model.kda.head_dim=128 --set=model.compute_dtype=bfloat16 \
        --backends=chunked,pallas --steps=10 --rounds=3 --out=OUT.json

What a user gains from a backend is a training step, not an op call. The
script builds the config's training program once per backend
(`model.kda.backend`), compiles each, then in every round runs `--steps`
steps of each backend in turn on the same batches, fetching the metrics
once at the end (the training loop's own rhythm), so a slow spell of the
machine hits every backend alike; the ratio to the first backend that ran
is taken within each round (paired). A backend that cannot take the model's calls is
reported with its reason (the op's `NotImplementedError`), not timed: our
kernels, for one, need K and V multiples of 128 and the fused lower-bound
gate. Off a TPU, `pallas` and `tokamax` run in Pallas interpret mode
(`--smoke`: a check of the script, not a measurement).

`--config` is `module[:variant]` of `configs/` (e.g. `mqar:tpu`, `text`);
`--set=field=value` overrides a field (a Python literal, else a string).
"""

import argparse
import ast
import contextlib
import importlib
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import kda_error_vs_length
from configs import common as config_lib
from experiments.tools import cli
from experiments.training import interpret
from experiments.training import train


def load_config(name, overrides):
  module, _, variant = name.partition(":")
  config = importlib.import_module(f"configs.{module}").get_config(
      variant or None)
  diff = {}
  for item in overrides:
    field, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"--set: field=value; got {item!r}.")
    try:
      diff[field] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      diff[field] = text
  return config_lib.apply_diff(config, diff)


def _kernels_here():
  """Interpret mode for the Pallas backends off a TPU (a smoke check)."""
  if jax.default_backend() == "tpu":
    return contextlib.nullcontext()
  return interpret.interpret_mode()


class Runner:
  """One backend's compiled training program and its state."""

  def __init__(self, config, backend):
    self.config = config_lib.apply_diff(config,
                                        {"model.kda.backend": backend})
    self.prog = train.build_program(self.config)
    self.batch_fn = train.train_batches(self.config, self.prog.task)
    self.params = self.prog.init(
        jax.random.key(0),
        jnp.zeros((1, self.config.task.seq_len), jnp.int32))
    self.opt = self.prog.init_opt(self.params)

  def steps(self, first, n):
    """Seconds a step over `n` steps from batch `first` (metrics fetched at
    the end)."""
    batches = [self.prog.put_batch(self.batch_fn(first + i)) for i in range(n)]
    jax.block_until_ready(batches)
    t = time.perf_counter()
    for batch in batches:
      self.params, self.opt, metrics = self.prog.train_step(
          self.params, self.opt, batch)
    jax.device_get(metrics)
    return (time.perf_counter() - t) / n


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="mqar:tpu")
  p.add_argument("--set", action="append", default=[], dest="overrides",
                 help="field=value, repeatable")
  p.add_argument("--backends", default="chunked,pallas")
  p.add_argument("--steps", type=cli.positive_int, default=10)
  p.add_argument("--rounds", type=cli.positive_int, default=3)
  p.add_argument("--smoke", action="store_true",
                 help="one round of two steps (a check of the script)")
  p.add_argument("--out", default=None, type=cli.output_path)
  a = p.parse_args()
  if a.smoke:
    a.steps, a.rounds = 2, 1
  config = load_config(a.config, a.overrides)
  runners, rows = {}, {}
  with _kernels_here():
    for backend in a.backends.split(","):
      try:
        t = time.perf_counter()
        runner = Runner(config, backend)
        runner.steps(0, 1)  # compile
        runners[backend] = runner
        rows[backend] = dict(compile_s=round(time.perf_counter() - t, 1),
                             step_ms=[], ratio_to_first=[])
      except NotImplementedError as e:
        rows[backend] = dict(not_run=str(e))
      print(json.dumps({backend: rows[backend]}), flush=True)
    for r in range(a.rounds):
      times = {b: run.steps(1 + r * a.steps, a.steps)
               for b, run in runners.items()}
      first = next(iter(times.values()), None)
      for b, s in times.items():
        rows[b]["step_ms"].append(round(1e3 * s, 3))
        rows[b]["ratio_to_first"].append(round(s / first, 4))
  for row in rows.values():
    if "step_ms" in row:
      row["median_step_ms"] = statistics.median(row["step_ms"])
      row["steps_per_s"] = round(1e3 / row["median_step_ms"], 2)
      row["median_ratio_to_first"] = statistics.median(row["ratio_to_first"])
  commit, dirty = kda_error_vs_length.git_commit()
  out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             host=platform.node(), commit=commit, dirty=dirty,
             config=a.config, overrides=a.overrides,
             steps=a.steps, rounds=a.rounds, backends=rows)
  print(json.dumps(out, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  cli.run_script(main)
