r"""Runs one task for every mixer (and seeds, learning rates); writes a table.

  python -m experiments.ablate --config=configs/mqar.py \
      --mixers=kda,kda_zeroed --seeds=0 --workdir=workdirs/mqar_ablation

Each run is the base config plus the one-line diff `{"model.mixer": name}`
(a name of `experiments.training.model.MIXERS`), with
`seed` and `train.learning_rate` set when --seeds / --learning_rates are
given. Runs go to `<workdir>/<mixer>_seed<s>_lr<lr>/` (each resumable, as
with run_experiment.py). The workdir gets `results.md` (one row per run:
mixer, learning rate, seed, best and final held-out accuracy, steps to 99%,
chance, wall time, steps/s), `results.json` (the run summaries) and
`accuracy.png` (held-out accuracy curves, one line per run). The table is
printed at the end. Every run's config is checked before the first trains;
a mistake (an unknown mixer, an empty or repeated list entry, a bad seed or
rate) is one line on stderr and exit status 2 (experiments/tools/cli.py;
`--verbose` adds the traceback).
"""

import json
import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from configs import common as config_lib
from experiments.training import compilation_cache
from experiments.training import metrics as metrics_lib
from experiments.training import model as model_lib
from experiments.training import plotting
from experiments.training import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Base experiment config, e.g. configs/mqar.py.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
_MIXERS = flags.DEFINE_list(
    "mixers", ["kda", "kda_zeroed"],
    f"Mixers to run, from {list(model_lib.MIXERS)}.")
_SEEDS = flags.DEFINE_list("seeds", None, "Seeds (default: the config's).")
_LEARNING_RATES = flags.DEFINE_list(
    "learning_rates", None, "Peak learning rates (default: the config's).")
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", compilation_cache.DEFAULT_DIR,
    compilation_cache.FLAG_HELP)


def run_name(mixer: str, seed: int, lr: float) -> str:
  return f"{mixer}_seed{seed}_lr{lr:g}"


def _fmt_acc(x) -> str:
  return "-" if x is None else f"{100 * x:.1f}%"


def results_table(rows: list[dict]) -> str:
  """A markdown table, one row per run summary."""
  lines = [
      "| mixer | lr | seed | best acc | final acc | steps to 99% | chance |"
      " steps | wall (s) | steps/s |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    sps = r.get("steps_per_second")
    lines.append(
        f"| {r['mixer']} | {r['learning_rate']:g} | {r['seed']} |"
        f" {_fmt_acc(r['best_eval_accuracy'])} |"
        f" {_fmt_acc(r['final_eval_accuracy'])} |"
        f" {r['steps_to_99'] if r['steps_to_99'] is not None else 'not reached'} |"
        f" {_fmt_acc(r['chance_accuracy'])} | {r['steps']} |"
        f" {r['wall_seconds']:.0f} | {'-' if sps is None else f'{sps:.2f}'} |")
  return "\n".join(lines)


def _check_axis(name: str, values) -> None:
  if not values:
    raise ValueError(f"--{name} is empty: give at least one value.")
  repeated = sorted({v for v in values if list(values).count(v) > 1})
  if repeated:
    raise ValueError(f"--{name} repeats {repeated}: give each value once.")


def ablation_runs(config, workdir: str, mixers, seeds, learning_rates):
  """[(mixer, run name, diff, config)] of every (mixer, seed, lr), each
  config checked: ValueError naming the field or flag otherwise."""
  for m in mixers:
    if m not in model_lib.MIXERS:
      raise ValueError(f"--mixers: {m!r} is not one of"
                       f" {list(model_lib.MIXERS)}.")
  for name, values in (("mixers", mixers), ("seeds", seeds),
                       ("learning_rates", learning_rates)):
    _check_axis(name, values)
  train.validate_config(config)  # the base config, before any diff
  train.check_folder(workdir)
  runs = []
  for mixer in mixers:
    for seed in seeds:
      for lr in learning_rates:
        diff = {"model.mixer": mixer, "seed": seed,
                "train.learning_rate": lr}
        cfg = config_lib.apply_diff(config, diff)
        name = run_name(mixer, seed, lr)
        train.check_run(cfg, os.path.join(workdir, name))
        runs.append((mixer, name, diff, cfg))
  return runs


def run_ablation(config, workdir: str, mixers, seeds, learning_rates):
  """Trains every (mixer, seed, lr); returns the summaries in order.

  Every run's config is checked (`ablation_runs`) before the first trains.
  """
  runs = ablation_runs(config, workdir, mixers, seeds, learning_rates)
  os.makedirs(workdir, exist_ok=True)
  summaries, curves = [], {}
  for mixer, name, diff, cfg in runs:
    logging.info("Ablation run %s: %s", name, diff)
    run_dir = os.path.join(workdir, name)
    summary = train.train_and_evaluate(cfg, run_dir)
    summaries.append(summary)
    evals = [r for r in metrics_lib.read_records(
        os.path.join(run_dir, "metrics.jsonl")) if r["split"] == "eval"]
    label = mixer if len(seeds) * len(learning_rates) == 1 else name
    curves[label] = ([r["step"] for r in evals],
                     [r["accuracy"] for r in evals])
  task = summaries[0]["task"]
  table = results_table(summaries)
  metrics_lib.write_atomic(os.path.join(workdir, "results.md"),
                           f"# {task}: ablation over mixers\n\n{table}\n")
  metrics_lib.write_atomic(os.path.join(workdir, "results.json"),
                           json.dumps(summaries, indent=2))
  plotting.plot_accuracy(curves, chance=summaries[0]["chance_accuracy"],
                         path=os.path.join(workdir, "accuracy.png"),
                         title=f"{task}: held-out accuracy by mixer")
  return summaries, table


def _numbers(flag, kind, default):
  """The values of a list flag as `kind`s; [default] when it is not given."""
  if flag.value is None:
    return [default]
  try:
    return [kind(x) for x in flag.value]
  except ValueError:
    raise app.UsageError(
        f"--{flag.name}={','.join(flag.value)}: every entry must be"
        f" {'an int' if kind is int else 'a number'}.") from None


def main(argv):
  del argv  # no positional arguments (cli.run)
  config = _CONFIG.value
  if config is None or not _WORKDIR.value:
    raise app.UsageError("--config and --workdir are required.")
  seeds = _numbers(_SEEDS, int, config.get("seed"))
  lrs = _numbers(_LEARNING_RATES, float,
                 config.get("train", {}).get("learning_rate"))
  ablation_runs(config, _WORKDIR.value, _MIXERS.value, seeds, lrs)  # checks
  compilation_cache.enable(_COMPILATION_CACHE_DIR.value)
  train.quiet_orbax_logs()
  _, table = run_ablation(config, _WORKDIR.value, _MIXERS.value, seeds, lrs)
  print(table)  # the CLI's one output: the final table

