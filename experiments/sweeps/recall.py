"""Recall against lag: how far back a trained model finds its answers.

A recall task scores a position whose answer is a token written earlier in
the same sequence; its *lag* is the distance back to that token:

* `palindrome`: the target x_{L-j} at position L + j was written at
  position L - j - 1, a lag of 2 j + 1 (1 .. 2 L - 1);
* `mqar`: the value of the queried key sits right after the key in the
  context; the lag runs from the query back to that value token;
* `stack`: the popped value was written by its PUSH (the `x` of
  `PUSH id x`); the lag runs from the POP's id token back to it.

Each such task's `answer_positions(batch)` recovers those positions from
the inputs alone (-1 where a position is not scored); `recall_profile(run_dir)`
runs a finished run's final parameters on its held-out set and bins held-out
accuracy by lag (bins [2^k, 2^(k+1))), and `sweep_recall_profiles` does that
for every finished run of a sweep (keeping the profiles it already holds),
writes `recall_vs_lag.json` (per run and per cell: mean, min and max over
seeds in every bin) and one figure per task, `recall_vs_lag_<task>.png` (a
panel per length, a line and band per mixer).

Where a cell's mean accuracy sits near chance this says whether the model
recalls nothing or only the recent part (the first reversed symbols of a
palindrome, the queries right after the context): a memory's reach, which a
bounded recurrent state has and attention does not need.

CLI: `python -m experiments.sweep --config=... --workdir=... --recall`.
"""

import json
import os
import warnings
from typing import Any, Sequence

from absl import logging
import jax
import numpy as np

from experiments import tasks as tasks_lib
from experiments.training import checkpoints
from experiments.training import metrics as metrics_lib
from experiments.training import model as model_lib
from experiments.training import plotting
from experiments.training import program as program_lib

# The tasks that say where each answer was written (`answer_positions`).
RECALL_TASKS = tuple(sorted(name for name, cls in tasks_lib.TASKS.items()
                            if callable(getattr(cls, "answer_positions",
                                                None))))


def _bin_edges(seq_len: int) -> np.ndarray:
  """1, 2, 4, ... up to the first power of two >= seq_len."""
  return 2 ** np.arange(int(np.ceil(np.log2(max(seq_len, 2)))) + 1)


def _final_params(config, run_dir: str, model, seq_len: int):
  """The last checkpoint's parameters (restored on this process's devices,
  whatever mesh the run trained on) and its step."""
  params = jax.jit(model.init)(jax.random.key(config.seed),
                               np.zeros((1, seq_len), np.int32))
  optimizer, _ = program_lib.make_optimizer(config.train)
  return checkpoints.latest_params(run_dir, params, optimizer.init(params))


def _held_out(config, task, n: int):
  """Yields (batch, rows, cols, bin) for the run's first `n` held-out batches:
  the scored positions (rows, cols) and the lag bin of each."""
  edges = _bin_edges(task.seq_len)
  for i in range(n):
    batch = task.sample(tasks_lib.rng(config.seed, tasks_lib.EVAL_STREAM, i),
                        config.train.eval_batch_size)
    src = task.answer_positions(batch)
    rows, cols = np.nonzero(src >= 0)
    lag = cols - src[rows, cols]
    yield batch, rows, cols, np.searchsorted(edges, lag, side="right") - 1


def _task(config):
  task = tasks_lib.make_task(**config.task.to_dict())
  if task.name not in RECALL_TASKS:
    raise ValueError(f"task.name must be one of {RECALL_TASKS} for a recall"
                     f" profile; got {task.name!r}.")
  return task


def held_out_counts(config, *, eval_batches: int | None = None) -> list[int]:
  """Scored positions of the run's held-out set in each lag bin (from the
  inputs alone: what a profile of that set must count)."""
  task = _task(config)
  n = config.train.eval_batches if eval_batches is None else eval_batches
  count = np.zeros(len(_bin_edges(task.seq_len)) - 1, np.int64)
  for _, _, _, k in _held_out(config, task, n):
    np.add.at(count, k, 1)
  return count.tolist()


def recall_profile(config, run_dir: str, *,
                   eval_batches: int | None = None) -> dict[str, Any]:
  """Held-out accuracy of the run's last checkpoint, binned by lag.

  Args:
    config: the run's config (a sweep run's `Run.config`).
    run_dir: the run directory (its checkpoints are read).
    eval_batches: held-out batches (default `train.eval_batches`: the set
      behind the run's reported accuracy).

  Returns:
    dict(step, accuracy (overall), lag_edges, correct, count): per lag bin
    [edges[k], edges[k + 1]) the number of correct and of scored positions;
    for a task with a memory-light rule (`baseline_correct`, Stack's last
    push), `beyond_baseline`: dict(correct, count) over the scored positions
    where that rule is wrong (on Stack, the POPs that need the stack).
  """
  task = _task(config)
  n = config.train.eval_batches if eval_batches is None else eval_batches
  with model_lib.host_context(config.model):
    model = model_lib.make_model(config.model, task.vocab_size)
    params, step = _final_params(config, run_dir, model, task.seq_len)
    apply = jax.jit(model.apply)
    edges = _bin_edges(task.seq_len)
    correct = np.zeros(len(edges) - 1, np.int64)
    count = np.zeros(len(edges) - 1, np.int64)
    rule = getattr(task, "baseline_correct", None)
    beyond = [0, 0]  # correct, scored where the rule is wrong
    for batch, rows, cols, k in _held_out(config, task, n):
      logits = np.asarray(apply(params, batch.inputs))
      hit = logits.argmax(-1) == batch.targets
      np.add.at(count, k, 1)
      np.add.at(correct, k, hit[rows, cols])
      if rule is not None:
        need = ~rule(batch)[rows, cols]
        beyond[0] += int(hit[rows, cols][need].sum())
        beyond[1] += int(need.sum())
  out = dict(step=int(step), accuracy=float(correct.sum() / count.sum()),
             lag_edges=edges.tolist(), correct=correct.tolist(),
             count=count.tolist())
  if rule is not None:
    out["beyond_baseline"] = dict(correct=beyond[0], count=beyond[1])
  return out


PROFILES_FILE = "recall_vs_lag.json"


def sweep_recall_profiles(sweep, workdir: str, runs, *,
                          eval_batches: int | None = None,
                          metadata: dict[str, Any] | None = None
                          ) -> dict[str, Any]:
  """Profiles every finished run of `runs` (sweep_lib.Run) on a recall task.

  A run already profiled in the workdir's `recall_vs_lag.json` keeps that
  profile when it is of the run's final step and of the same held-out set
  (its bins count what `held_out_counts` counts); the others are profiled
  from their last checkpoint. So profiling again after more runs finish
  profiles only those, and a workdir whose checkpoints are gone (run
  directories copied without them) keeps the profiles it had; a finished
  run with neither is logged and listed under `unprofiled`.

  Writes `recall_vs_lag.json` (with `metadata`, e.g. the commit that
  profiled, at the top and in each run's profile that this call made) and
  `recall_vs_lag_<task>.png` into `workdir` and returns the JSON's
  contents.
  """
  path = os.path.join(workdir, PROFILES_FILE)
  known, known_metadata = {}, {}
  if os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
    known, known_metadata = previous["runs"], previous["metadata"]
  per_run, cells, chance, unprofiled = {}, {}, {}, []
  for run in runs:
    run_dir = os.path.join(workdir, run.name)
    summary_path = os.path.join(run_dir, "summary.json")
    if run.task not in RECALL_TASKS or not os.path.exists(summary_path):
      continue
    with open(summary_path) as f:
      summary = json.load(f)
    chance[(run.task, run.seq_len)] = summary["chance_accuracy"]
    prof = _run_profile(run, run_dir, summary["steps"],
                        known.get(run.name), known_metadata,
                        eval_batches=eval_batches, metadata=metadata)
    if prof is None:
      unprofiled.append(run.name)
      continue
    per_run[run.name] = prof
    cells.setdefault((run.task, run.seq_len, run.mixer), []).append(prof)
  records = [_cell_record(task, seq_len, mixer, profs)
             for (task, seq_len, mixer), profs in sorted(cells.items())]
  out = dict(metadata=metadata or {}, runs=per_run, cells=records,
             unprofiled=unprofiled)
  metrics_lib.write_atomic(path, json.dumps(out, indent=1))
  mixers = [m for m in list(sweep.mixers) + [
      sweep.get("ablation", {}).get("mixer")] if m]
  for task in sorted({r["task"] for r in records}):
    plot_recall(records, task, mixers, chance,
                os.path.join(workdir, f"recall_vs_lag_{task}.png"))
  return out


def _run_profile(run, run_dir: str, steps: int, known, known_metadata, *,
                 eval_batches: int | None, metadata: dict[str, Any] | None
                 ) -> dict[str, Any] | None:
  """A finished run's profile: `known` (the workdir's) when it is of the
  run's final step (`steps`) and of the same held-out set, else one made
  from its last checkpoint; None, logged, when it has neither."""
  has_rule = hasattr(tasks_lib.TASKS[run.task], "baseline_correct")
  if (known is not None and known["step"] == steps
      and known["count"] == held_out_counts(run.config,
                                            eval_batches=eval_batches)
      and ("beyond_baseline" in known or not has_rule)):
    # Of the final step and the same held-out set: kept, and who profiled
    # it stays recorded.
    return {**known_metadata, **known}
  if checkpoints.has_checkpoint(run_dir):
    prof = {**recall_profile(run.config, run_dir,
                             eval_batches=eval_batches), **(metadata or {})}
    logging.info("Recall profile of %s: accuracy %.4f at step %d.",
                 run.name, prof["accuracy"], prof["step"])
    return prof
  logging.warning("Run %s has no checkpoint and no profile of its"
                  " final step; not profiled.", run.name)
  return None


def _cell_record(task: str, seq_len: int, mixer: str,
                 profs: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """A cell's profile over its seeds: mean, min and max in every lag bin."""
  acc = np.array([[c / n if n else np.nan for c, n in
                   zip(p["correct"], p["count"])] for p in profs])
  with warnings.catch_warnings():  # a bin no seed reached stays NaN
    warnings.simplefilter("ignore", RuntimeWarning)
    mean, low, high = (np.nanmean(acc, 0), np.nanmin(acc, 0),
                       np.nanmax(acc, 0))
  beyond = [b["correct"] / b["count"] for p in profs
            if (b := p.get("beyond_baseline")) and b["count"]]
  return dict(
      task=task, seq_len=seq_len, mixer=mixer, seeds=len(profs),
      lag_edges=profs[0]["lag_edges"],
      count=np.sum([p["count"] for p in profs], 0).tolist(),
      mean=_nan_list(mean), min=_nan_list(low), max=_nan_list(high),
      beyond_baseline=(dict(mean=float(np.mean(beyond)),
                            min=float(np.min(beyond)),
                            max=float(np.max(beyond)))
                       if beyond else None))


def _nan_list(x) -> list[float | None]:
  return [None if np.isnan(v) else float(v) for v in x]


def plot_recall(records: Sequence[dict[str, Any]], task: str, mixers,
                chance, path: str) -> None:
  """One panel per length of `task`: accuracy per lag bin, band over seeds."""
  series, panels, panel_chance = {}, [], {}
  for r in sorted((r for r in records if r["task"] == task),
                  key=lambda r: r["seq_len"]):
    panel = f"{task} T={r['seq_len']}"
    if panel not in panels:
      panels.append(panel)
    panel_chance[panel] = chance.get((task, r["seq_len"]))
    keep = [k for k, m in enumerate(r["mean"]) if m is not None]
    x = [r["lag_edges"][k] for k in keep]
    series[(panel, r["mixer"])] = (
        x, [r["mean"][k] for k in keep], [r["min"][k] for k in keep],
        [r["max"][k] for k in keep], [r["seeds"]] * len(keep))
  plotting.plot_bands_by_task(
      series, tasks=panels, mixers=mixers, chance=panel_chance, log_x=True,
      xlabel="lag: tokens back to the answer (bin [x, 2x))",
      ylabel="held-out accuracy (%)",
      title="recall against lag, final parameters (mean, band: min-max over"
      " seeds)", path=path)
