"""The sweep: grid expansion, resumable runs, parallel claims, aggregation."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs.sweeps import kimi_synthetic
from configs.sweeps import kimi_synthetic_600steps
from configs.sweeps import parity as sweep_parity
from experiments import tasks
from experiments.sweeps import recall
from experiments.sweeps import sweep_lib
from experiments.sweeps import sweep_markdown
from experiments.sweeps import sweep_report
from experiments.training import metrics
from experiments.training import model as model_lib
from experiments.training import program as program_lib
from experiments.training import train
from tests import conftest
from tests.experiments import argmax_ties

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _cpu_env():
  """The environment of a command: on the host's CPU (one process at a time
  holds a TPU, and this one may)."""
  return {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_the_kimi_synthetic_runs_are_valid_and_shared_where_equal():
  runs = sweep_lib.expand(kimi_synthetic.get_config())
  assert len({r.name for r in runs}) == len(runs)
  for r in runs:  # every run's config is one the trainer accepts
    program_lib.validate_config(r.config)
    assert r.config.task.seq_len == r.seq_len
    assert r.config.model.mixer == r.mixer and r.config.seed == r.seed
  # Seeds outermost: a partial sweep has whole seeds, not whole cells.
  seeds = [r.seed for r in runs if r.mixer != "kda_zeroed"]
  assert seeds == sorted(seeds)
  # A calibration run with a protocol run's name is that run (one workdir
  # serves both), whatever rates each config lists.
  protocol = {r.name: r.config for r in runs}
  calibration = sweep_lib.expand(kimi_synthetic.get_config("calibration"))
  shared = [r for r in calibration if r.name in protocol]
  assert shared and all(r.config == protocol[r.name] for r in shared)
  # Each mixer runs at its task's chosen rate, one the calibration tried:
  # the protocol's seed-0 runs at 1024 are calibration runs.
  for r in runs:
    rate = kimi_synthetic.LEARNING_RATES[r.task][r.mixer.replace(
        "kda_zeroed", "kda")]
    assert r.learning_rate == rate
  assert {r.name for r in runs if r.seed == 0 and r.seq_len == 1024} <= {
      r.name for r in calibration}
  # The calibration's grid, and the one rate past it (attention on Stack).
  stack = {(r.mixer, r.learning_rate) for r in calibration
           if r.task == "stack"}
  assert stack == {(m, lr) for m in ("kda", "gdn", "attention")
                   for lr in kimi_synthetic.CALIBRATION_RATES} | {
                       ("attention", 1e-2)}
  assert len(calibration) == 3 * 3 * 3 + 1
  # The T = 256 rate checks: seed 0 at rates the protocol does not run
  # there, so each is a run of its own beside the protocol's.
  checks = [r for arg in ("rates256_stack", "rates256_palindrome")
            for r in sweep_lib.expand(kimi_synthetic.get_config(arg))]
  assert {(r.task, r.mixer, r.learning_rate) for r in checks} == {
      ("stack", "attention", 5e-4), ("stack", "attention", 1e-3),
      ("stack", "attention", 1e-2), ("palindrome", "kda", 1e-3),
      ("palindrome", "gdn", 3e-3)}
  assert all(r.seq_len == 256 and r.seed == 0 and r.name not in protocol
             for r in checks)
  for r in checks:  # the protocol's cell but for the rate
    (same,) = [p for p in runs if (p.task, p.seq_len, p.mixer, p.seed) == (
        r.task, 256, r.mixer, 0)]
    mine, theirs = r.config.to_dict(), same.config.to_dict()
    assert mine["train"].pop("learning_rate") != theirs["train"].pop(
        "learning_rate")
    assert mine == theirs
  for r in sweep_lib.expand(kimi_synthetic_600steps.get_config()):
    program_lib.validate_config(r.config)


def test_palindrome_curriculum_doubles_up_from_256():
  assert kimi_synthetic.palindrome_curriculum(256) == ()
  assert kimi_synthetic.palindrome_curriculum(1024, 7) == ((7, 256),
                                                           (7, 512))


@pytest.mark.slow
def test_extend_to_continues_the_unsolved_runs(tmp_path):
  sweep = kimi_synthetic.get_config("smoke")
  workdir = str(tmp_path)
  only = "stack_T32/kda_seed0"
  (run,) = sweep_lib.run_sweep(sweep, workdir, only=only)
  run_dir = os.path.join(workdir, run.name)
  assert sweep_lib.is_done(run_dir, run.config)
  assert sweep_lib.run_sweep(sweep, workdir, only=only) == []
  (extended,) = sweep_lib.extend([run], 8)
  assert not sweep_lib.is_done(run_dir, extended.config)
  assert sweep_lib.run_sweep(sweep, workdir, only=only, extend_to=8)
  with open(os.path.join(run_dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["steps"] == 8 and summary["steps_trained_this_run"] == 4
  # Aggregated with the sweep's own cap, the extended run reports its own.
  results = sweep_report.aggregate(sweep, workdir)
  assert results["runs"][0]["num_steps"] == 8
  cosine = sweep_lib.expand(kimi_synthetic_600steps.get_config())[:1]
  with pytest.raises(ValueError, match="extend_to needs train.schedule"):
    sweep_lib.extend(cosine, 1000)


@pytest.mark.slow
def test_extend_step_continues_only_the_runs_still_rising(tmp_path):
  # The smoke runs train 4 steps: too few for a plateau window, so each
  # finishes "rising at cap" (metrics.run_status).
  sweep = kimi_synthetic.get_config("smoke")
  workdir, only = str(tmp_path), "stack_T32/kda_"
  rising, flat = "stack_T32/kda_seed0_lr0.003", "stack_T32/kda_seed1_lr0.003"
  (first,) = sweep_lib.run_sweep(sweep, workdir, only=only + "seed0")

  def summary(name):
    with open(os.path.join(workdir, name, "summary.json")) as f:
      return json.load(f)

  def write(name, file, text):
    with open(os.path.join(workdir, name, file), "w") as f:
      f.write(text)

  assert first.name == rising and summary(rising)["status"] == "rising at cap"
  # The runs not yet trained to the sweep's cap train first; then the
  # rising ones continue.
  trained = sweep_lib.run_sweep(sweep, workdir, only=only + "seed1",
                                extend_to=10, extend_step=3)
  assert [(r.name, r.config.train.num_steps) for r in trained] == [
      (flat, 4), (flat, 7), (flat, 10)]
  shutil.rmtree(os.path.join(workdir, flat))
  sweep_lib.run_sweep(sweep, workdir, only=only + "seed1")
  # The status is read from the metrics by this code's rule, whatever the
  # summary says: a flat held-out curve (1000 steps at 30%, a constant
  # rate) is a plateau under a summary that says "rising at cap".
  write(flat, "metrics.jsonl", "".join(
      json.dumps(r) + "\n" for r in
      [dict(step=s, split="train", learning_rate=3e-3, loss=1.0,
            accuracy=0.3, steps_per_second=2.0) for s in range(10, 1001, 10)]
      + [dict(step=s, split="eval", loss=1.0, accuracy=0.3)
         for s in range(0, 1001, 25)]))
  assert summary(flat)["status"] == "rising at cap"
  trained = sweep_lib.run_sweep(sweep, workdir, only=only, extend_to=10,
                                extend_step=3)
  # 4 -> 7 -> 10, one round each; the plateaued run is left at 4.
  assert [(r.name, r.config.train.num_steps) for r in trained] == [
      (rising, 7), (rising, 10)]
  assert summary(rising)["steps"] == 10 and summary(flat)["steps"] == 4
  assert sweep_lib.run_sweep(sweep, workdir, only=only, extend_to=10,
                             extend_step=3) == []
  # An extension killed before it finished (config.json asks for more steps
  # than the summary holds) resumes to its own cap, past extend_to.
  with open(os.path.join(workdir, rising, "config.json")) as f:
    config = json.load(f)
  config["train"]["num_steps"] = 13
  write(rising, "config.json", json.dumps(config))
  (again,) = sweep_lib.run_sweep(sweep, workdir, only=only, extend_to=10,
                                 extend_step=3)
  assert again.config.train.num_steps == 13
  assert summary(rising)["steps"] == 13
  with pytest.raises(ValueError, match="extend_step needs extend_to"):
    sweep_lib.run_sweep(sweep, workdir, only=only, extend_step=3)
  with pytest.raises(ValueError, match="extend_step must be an int >= 1"):
    sweep_lib.run_sweep(sweep, workdir, only=only, extend_to=20,
                        extend_step=0)
  cosine = kimi_synthetic_600steps.get_config()  # refused before training
  with pytest.raises(ValueError, match="extend_to needs train.schedule"):
    sweep_lib.run_sweep(cosine, str(tmp_path / "cosine"), extend_to=20,
                        extend_step=3)
  assert not os.path.exists(tmp_path / "cosine")


@pytest.mark.slow
def test_depth_first_takes_each_run_to_its_end_before_the_next(tmp_path):
  sweep = kimi_synthetic.get_config("smoke")
  only = "stack_T32/kda_"
  a, b = "stack_T32/kda_seed0_lr0.003", "stack_T32/kda_seed1_lr0.003"
  trained = sweep_lib.run_sweep(sweep, str(tmp_path / "depth"), only=only,
                                extend_to=10, extend_step=3,
                                depth_first=True)
  assert [(r.name, r.config.train.num_steps) for r in trained] == [
      (a, 4), (a, 7), (a, 10), (b, 4), (b, 7), (b, 10)]
  with pytest.raises(ValueError, match="depth_first needs extend_step"):
    sweep_lib.run_sweep(sweep, str(tmp_path / "depth"), only=only,
                        extend_to=10, depth_first=True)


def test_the_overview_marks_runs_still_learning_under_their_rule():
  def cell(mixer, statuses):
    return dict(task="text", seq_len=256, mixer=mixer, seeds=[0, 1],
                best_accuracy=dict(mean=0.7, min=0.6, max=0.8),
                steps_to_99=None, num_reached_99=0, statuses=statuses,
                chance_accuracy=1 / 256)
  loss = "\n".join(sweep_markdown._overview_lines(
      [cell("kda", {"falling at cap": 1, "converged": 1}),
       cell("gdn", {"converged": 2})]))
  assert "† where a run of the cell was still falling at its cap." in loss
  assert "| text | 256 | 0.4 | 70.0 [60.0, 80.0] (2) † | 70.0 [60.0, 80.0]" \
      " (2) |" in loss
  accuracy = "\n".join(sweep_markdown._overview_lines(
      [cell("kda", {"rising at cap": 2}), cell("gdn", {"plateaued": 2})]))
  assert "still rising at its cap." in accuracy


def test_compare_gives_a_verdict_per_cell():
  def cell(mixer, best):
    return dict(task="mqar", seq_len=64, mixer=mixer,
                best_by_seed=dict(enumerate(best)))
  cells = [cell("kda", [0.5, 0.6, 0.7]), cell("gdn", [0.4, 0.5, 0.6]),
           cell("attention", [0.6, 0.5, 0.9]), cell("none", [1.0, 0.995]),
           cell("tie", [0.505, 0.595, 0.708]),
           cell("near", [0.495, 0.57, 0.68])]
  every = sweep_report.compare(
      cells, ("kda", "gdn", "attention", "none", "tie", "near"))
  assert len(every) == 15  # every pair, once
  out = {c["other"]: c for c in every if c["mixer"] == "kda"}
  (pair,) = [c for c in every if (c["mixer"], c["other"]) == ("gdn", "near")]
  assert pair["difference"]["mean"] == pytest.approx(
      np.mean([0.4 - 0.495, 0.5 - 0.57, 0.6 - 0.68]))
  assert pair["verdict"] == "behind in every seed"
  assert out["gdn"]["verdict"] == "ahead in every seed"
  assert out["gdn"]["difference"]["mean"] == pytest.approx(0.1)
  assert out["attention"]["verdict"] == "mixed"
  assert out["none"]["seeds"] == [0, 1]
  assert out["none"]["verdict"] == "behind in every seed"
  # Gaps within TIE_MARGIN (1 point) are no order; one seed inside it and
  # the others ahead is no order in every seed either.
  assert out["tie"]["verdict"] == "within 1 point in every seed"
  assert out["near"]["verdict"] == "mixed"
  solved = [cell("kda", [0.99, 1.0]), cell("gdn", [1.0, 0.995])]
  (both,) = sweep_report.compare(solved, ("kda", "gdn"))
  assert both["verdict"] == "both solve in every seed"


def test_compare_at_equal_steps_reads_each_pair_at_the_shorter_run():
  # Seed 0: kda stopped at 100 steps, gdn went on to 300 and overtook it;
  # seed 1: both ran 200 steps.
  curves = {
      ("palindrome", 64, "kda", 0): ([0, 50, 100], [0.1, 0.4, 0.5]),
      ("palindrome", 64, "gdn", 0): ([0, 50, 100, 200, 300],
                                     [0.1, 0.3, 0.45, 0.6, 0.7]),
      ("palindrome", 64, "kda", 1): ([0, 100, 200], [0.1, 0.5, 0.55]),
      ("palindrome", 64, "gdn", 1): ([0, 100, 200], [0.1, 0.6, 0.52]),
  }
  cells = [dict(task="palindrome", seq_len=64, mixer=m,
                best_by_seed={s: max(curves[("palindrome", 64, m, s)][1])
                              for s in (0, 1)}) for m in ("kda", "gdn")]
  (c,) = sweep_report.compare(cells, ("kda", "gdn"), curves)
  # As trained: 0.5 - 0.7 and 0.55 - 0.6, gdn ahead in both seeds.
  assert c["verdict"] == "behind in every seed"
  assert c["difference"]["min"] == pytest.approx(-0.2)
  eq = c["equal_steps"]
  assert eq["steps"] == {0: 100, 1: 200}
  # At 100 steps kda leads seed 0 (0.5 vs 0.45); at 200, gdn seed 1 (best
  # 0.55 vs 0.6): no order at equal steps.
  assert eq["difference"]["max"] == pytest.approx(0.05)
  assert eq["difference"]["min"] == pytest.approx(-0.05)
  assert eq["verdict"] == "mixed"
  lines = sweep_markdown._comparison_lines([c])
  assert lines[-1] == ("| palindrome | 64 | kda - gdn | 2 | 100 / 200 |"
                       " +0.0 [-5.0, +5.0] | mixed | -12.5 [-20.0, -5.0] |"
                       " behind in every seed |")


def test_rates_tried_lists_every_rate_per_length_and_seed(tmp_path):
  def run(name, accs, every=25):
    path = tmp_path / name
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(
        json.dumps(dict(step=every * i, split="eval", accuracy=a)) + "\n"
        for i, a in enumerate(accs)))
  run("stack_T256/attention_seed0_lr0.003", [0.1, 0.3, 0.35])
  run("stack_T256/attention_seed0_lr0.01", [0.1, 0.9])  # 25 steps
  run("stack_T256/attention_seed1_lr0.003", [0.1, 0.2])
  run("stack_T256/kda_seed0_lr0.003", [0.1, 0.2])
  run("stack_T512/attention_seed2_lr0.003", [0.1, 0.2])
  (att,) = [r for r in sweep_report.rates_tried(str(tmp_path), ("attention",))]
  assert att["lengths"][256] == [
      dict(seeds=[0], rates=[0.003, 0.01], steps=25, best=[0.3, 0.9]),
      dict(seeds=[1], rates=[0.003], steps=None, best=None)]
  assert att["lengths"][512] == [
      dict(seeds=[2], rates=[0.003], steps=None, best=None)]
  cells = [dict(task="stack", mixer="attention", learning_rate=0.003)]
  lines = sweep_markdown._rate_lines([att], cells)
  assert lines[-1] == ("| stack | attention | 0.003 | seed 0 at 25 steps:"
                       " 0.003 30.0, 0.01 90.0; 0.003 only (seed 1) |"
                       " 0.003 only (seed 2) |")


def test_overview_is_one_row_per_task_and_length():
  def cell(mixer, best, steps=None, statuses=None):
    return dict(task="mqar", seq_len=64, mixer=mixer, chance_accuracy=0.25,
                seeds=list(range(len(best))),
                best_accuracy=dict(mean=np.mean(best), min=min(best),
                                   max=max(best)),
                steps_to_99=steps, num_reached_99=sum(b >= 0.99 for b in best),
                statuses=statuses)
  lines = sweep_markdown._overview_lines([
      cell("kda", [1.0, 0.99], dict(mean=150.0, min=100.0, max=200.0),
           {"solved": 2}),
      cell("gdn", [0.995, 0.5], dict(mean=300.0, min=300.0, max=300.0),
           {"solved": 1, "rising at cap": 1})])
  assert lines[-1] == ("| mqar | 64 | 25.0 | 99.5 [99.0, 100.0] (2), 99% at"
                       " 150 | 74.8 [50.0, 99.5] (2) † |")
  # A task's baseline gets a column; a task without one shows "-".
  with_base = cell("kda", [0.6])
  with_base.update(task="stack", baseline_accuracy=dict(mean=0.9, min=0.9,
                                                        max=0.9))
  lines = sweep_markdown._overview_lines([with_base, cell("kda", [0.3]),
                                        cell("gdn", [0.2])])
  assert lines[-4] == "| task | T | chance % | baseline % | kda | gdn |"
  assert lines[-3] == "|---|---|---|---|---|---|"
  assert lines[-2].startswith("| mqar | 64 | 25.0 | - | 30.0")
  assert lines[-1].startswith("| stack | 64 | 25.0 | 90.0 | 60.0")


def test_sweep_config_errors():
  sweep = kimi_synthetic.get_config("smoke")
  with pytest.raises(ValueError, match="variant"):
    kimi_synthetic.get_config("tiny")
  bad = sweep.copy_and_resolve_references()
  bad.unlock()
  bad.cells = bad.cells + (bad.cells[0],)
  with pytest.raises(ValueError, match="repeats the cell"):
    sweep_lib.expand(bad)
  bad.cells = ()
  with pytest.raises(ValueError, match="sweep.cells must be non-empty"):
    sweep_lib.expand(bad)


SMOKE_ONLY = "stack_T32/kda_"  # two seeds of one cell: enough to aggregate
SMOKE_RUNS = ["stack_T32/kda_seed0_lr0.003", "stack_T32/kda_seed1_lr0.003"]


# The process's memory maps before and after the `smoke_sweep` fixture's
# sweep (`conftest.memory_maps`).
_MAPS_AROUND_SWEEP = []


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
  """(sweep, workdir, trained runs): the smoke sweep's two runs, trained once
  per test process; tests that change the workdir take a copy."""
  sweep = kimi_synthetic.get_config("smoke")
  workdir = str(tmp_path_factory.mktemp("smoke_sweep"))
  before = conftest.memory_maps()
  trained = sweep_lib.run_sweep(sweep, workdir, only=SMOKE_ONLY,
                                code_version="c1")
  _MAPS_AROUND_SWEEP[:] = [before, conftest.memory_maps()]
  return sweep, workdir, trained


def _copy(smoke_sweep, tmp_path):
  sweep, workdir, trained = smoke_sweep
  copy = str(tmp_path / "workdir")
  shutil.copytree(workdir, copy)
  return sweep, copy, trained


@pytest.mark.xdist_group("smoke_sweep")
def test_smoke_sweep_trains_each_run_once_and_skips_held_ones(
    smoke_sweep, tmp_path):
  sweep, workdir, trained = _copy(smoke_sweep, tmp_path)
  assert sorted(r.name for r in trained) == SMOKE_RUNS
  for r in trained:
    run_dir = os.path.join(workdir, r.name)
    assert os.path.isfile(os.path.join(run_dir, "summary.json"))
    assert not os.path.exists(run_dir + ".lock")
  # Rerunning trains nothing; a run held by a live process is skipped.
  assert sweep_lib.run_sweep(sweep, workdir, only=SMOKE_ONLY) == []
  held = os.path.join(workdir, "palindrome_T16/kda_seed0_lr0.003")
  os.makedirs(os.path.dirname(held), exist_ok=True)
  with open(held + ".lock", "w") as f:
    f.write(str(os.getppid()))
  assert sweep_lib.run_sweep(
      sweep, workdir, only="palindrome_T16/kda_seed0") == []
  with pytest.raises(ValueError, match="no run of the sweep"):
    sweep_lib.run_sweep(sweep, workdir, only="nothing")
  # A run resumed at another commit lists both; the same commit once.
  sweep_lib.record_commit(os.path.join(workdir, trained[0].name), "c2")
  sweep_lib.record_commit(os.path.join(workdir, trained[0].name), "c2")
  assert sweep_lib.read_commits(
      os.path.join(workdir, trained[0].name)) == ["c1", "c2"]
  # A run that trains again from step 0 (no checkpoint: a committed run
  # extended) starts a new list.
  run_dir = os.path.join(workdir, trained[0].name)
  shutil.rmtree(os.path.join(run_dir, "checkpoints"))
  os.remove(os.path.join(run_dir, "summary.json"))
  assert [r.name for r in sweep_lib.run_sweep(
      sweep, workdir, only=trained[0].name, code_version="c3")] == [
          trained[0].name]
  assert sweep_lib.read_commits(run_dir) == ["c3"]


@pytest.mark.xdist_group("smoke_sweep")
@pytest.mark.skipif(conftest.memory_maps() is None,
                    reason="this host's /proc does not count memory maps")
def test_a_sweep_process_lets_each_finished_runs_programs_go(
    smoke_sweep, tmp_path):
  _, _, trained = smoke_sweep
  before, after_sweep = _MAPS_AROUND_SWEEP
  # A third run of the cell trained directly (not by the sweep): the maps
  # one run's programs hold while the process keeps them.
  config = trained[0].config.copy_and_resolve_references()
  config.seed = 7
  start = conftest.memory_maps()
  train.train_and_evaluate(config, str(tmp_path / "run"))
  one_run = conftest.memory_maps() - start
  assert one_run > 200, (before, after_sweep, one_run)
  # The sweep trained two runs and kept neither's programs.
  assert after_sweep - before < one_run // 2, (before, after_sweep, one_run)


@pytest.mark.xdist_group("smoke_sweep")
def test_smoke_sweep_aggregates_its_seeds(smoke_sweep, tmp_path):
  sweep, workdir, _ = _copy(smoke_sweep, tmp_path)
  results = sweep_report.aggregate(sweep, workdir, metadata=dict(commit="x"))
  assert results["num_finished"] == 2 and results["num_runs"] == 13
  (kda,) = [c for c in results["cells"] if c["mixer"] == "kda"]
  best = []
  for seed in (0, 1):
    with open(os.path.join(workdir, f"stack_T32/kda_seed{seed}_lr0.003",
                           "metrics.jsonl")) as f:
      best.append(max(r["accuracy"] for r in map(json.loads, f)
                      if r["split"] == "eval"))
  assert kda["seeds"] == [0, 1]
  assert kda["best_accuracy"]["mean"] == pytest.approx(np.mean(best))
  assert kda["best_accuracy"]["min"] == pytest.approx(min(best))
  # Stack's baseline on each seed's held-out set (the smoke cell's task and
  # eval sizes), averaged over the seeds.
  task = tasks.Stack(seq_len=32, num_stacks=4, num_values=4)
  assert kda["baseline_accuracy"]["mean"] == pytest.approx(np.mean([
      tasks.baseline_accuracy(task, [task.sample(
          tasks.rng(seed, tasks.EVAL_STREAM, 0), 4)]) for seed in (0, 1)]))
  for name in ("results.json", "results.md", "accuracy_vs_length.png",
               "curves_T32.png"):
    assert os.path.isfile(os.path.join(workdir, name)), name
  # Held-out bits per byte are drawn only for a byte corpus.
  assert not os.path.exists(os.path.join(workdir,
                                         "bits_per_byte_curves_T32.png"))
  with open(os.path.join(workdir, "results.md")) as f:
    md = f.read()
  assert "2 of 13 runs finished" in md and "| stack | 32 | kda |" in md
  assert "Runs trained at: c1 (2 runs)." in md
  # Each run records the device it trained on (this process's: a chip's
  # kind on a TPU host); the hours are split by it.
  kind = re.escape(jax.devices()[0].device_kind)
  assert re.search(r"Trained on \(the device of each run's last part\):"
                   rf" (\d+ x )?{kind} \(2 runs, \d+\.\d\d hours\)\.", md), md
  # The workdir's compute counts run directories outside the sweep too (a
  # calibration's), and every part of the sweep's own.
  spent = results["workdir_compute"]
  assert spent["train_seconds"] >= results["train_seconds"] > 0
  other = os.path.join(workdir, "calibration_T32", "kda_seed0_lr0.01")
  os.makedirs(other)
  shutil.copy(os.path.join(workdir, "stack_T32/kda_seed0_lr0.003",
                           "metrics.jsonl"), other)
  again = sweep_report.aggregate(sweep, workdir)["workdir_compute"]
  assert again["runs"] == spent["runs"] + 1
  assert again["train_seconds"] == pytest.approx(
      spent["train_seconds"] + metrics.train_seconds(
          metrics.read_records(os.path.join(other, "metrics.jsonl"))))


@pytest.mark.xdist_group("smoke_sweep")
def test_recall_bins_add_up_to_each_runs_accuracy(smoke_sweep, tmp_path):
  sweep, workdir, trained = _copy(smoke_sweep, tmp_path)
  subprocess.run(
      [sys.executable, "-m", "experiments.sweep",
       "--config=configs/sweeps/kimi_synthetic.py:smoke",
       f"--workdir={workdir}", "--recall", f"--only={SMOKE_ONLY}"],
      cwd=REPO, capture_output=True, text=True, check=True,
      env=_cpu_env())
  with open(os.path.join(workdir, "recall_vs_lag.json")) as f:
    prof = json.load(f)
  assert sorted(prof["runs"]) == [r.name for r in trained]
  per_seed = []
  for r in trained:
    with open(os.path.join(workdir, r.name, "summary.json")) as f:
      final = json.load(f)["final_eval_accuracy"]
    p = prof["runs"][r.name]
    tr, task = r.config.train, tasks.make_task(**r.config.task.to_dict())
    # Two programs scored the final parameters (the profile's jit of
    # model.apply, the training's eval step): the same hit count, but for
    # positions whose top two logits lie within float32 rounding.
    with model_lib.host_context(r.config.model):
      model = model_lib.make_model(r.config.model, task.vocab_size)
      # pylint: disable-next=protected-access
      params, _ = recall._final_params(r.config, os.path.join(workdir, r.name),
                                       model, task.seq_len)
      argmax_ties.assert_same_hits(
          sum(p["correct"]) / sum(p["count"]), final, model, params, params,
          train.eval_set(r.config, task), r.name)
    assert sum(p["count"]) == sum(  # every scored position of the set
        task.sample(tasks.rng(r.seed, tasks.EVAL_STREAM, i),
                    tr.eval_batch_size).mask.sum()
        for i in range(tr.eval_batches))
    per_seed.append([c / n if n else np.nan
                     for c, n in zip(p["correct"], p["count"])])
    # Stack's POPs that need the stack: those the last-push rule gets wrong.
    beyond = p["beyond_baseline"]
    assert beyond["count"] == sum(
        int((~task.baseline_correct(b) & (b.mask > 0)).sum())
        for b in (task.sample(tasks.rng(r.seed, tasks.EVAL_STREAM, i),
                              tr.eval_batch_size)
                  for i in range(tr.eval_batches)))
    assert 0 <= beyond["correct"] <= beyond["count"]
  (cell,) = prof["cells"]
  ratios = [b["correct"] / b["count"] for r in trained
            if (b := prof["runs"][r.name]["beyond_baseline"])["count"]]
  if ratios:
    assert cell["beyond_baseline"]["mean"] == pytest.approx(np.mean(ratios))
  else:
    assert cell["beyond_baseline"] is None
  assert cell["seeds"] == 2 and cell["mixer"] == "kda"
  for k, mean in enumerate(cell["mean"]):
    column = [a[k] for a in per_seed if not np.isnan(a[k])]
    assert (mean is None) == (not column)
    if column:
      assert mean == pytest.approx(np.mean(column))
      assert cell["min"][k] == pytest.approx(min(column))
  assert os.path.isfile(os.path.join(workdir, "recall_vs_lag_stack.png"))
  _check_profiles_are_kept(sweep, workdir, trained, prof)


def _check_profiles_are_kept(sweep, workdir, trained, prof):
  """Profiling again keeps a run's profile of its final step and held-out
  set, with who made it, even with the checkpoints gone (a workdir rebuilt
  from committed results); a stale profile is remade from the checkpoints,
  or the run is listed as unprofiled when they are gone."""
  shutil.rmtree(os.path.join(workdir, trained[0].name, "checkpoints"))
  kept = recall.sweep_recall_profiles(sweep, workdir, trained,
                                      metadata=dict(profiled_at="c3"))
  assert kept["unprofiled"] == []
  for r in trained:
    assert kept["runs"][r.name] == prof["runs"][r.name]
    assert kept["runs"][r.name]["profiled_at"] != "c3"
  assert kept["cells"] == prof["cells"]
  assert trained[0].config.train.eval_batches == 1
  two = recall.sweep_recall_profiles(  # another held-out set
      sweep, workdir, trained, eval_batches=2, metadata=dict(profiled_at="c4"))
  assert two["unprofiled"] == [trained[0].name]
  (p,) = two["runs"].values()
  assert p["profiled_at"] == "c4" and sum(p["count"]) > sum(
      prof["runs"][trained[1].name]["count"])
  assert p["count"] == recall.held_out_counts(trained[1].config,
                                              eval_batches=2)


@pytest.mark.xdist_group("smoke_sweep")
def test_an_edited_sweep_refuses_the_old_runs_but_not_new_logging(
    smoke_sweep, tmp_path):
  sweep, workdir, _ = _copy(smoke_sweep, tmp_path)
  edited = sweep.copy_and_resolve_references()
  edited.unlock()
  edited.cells = (dict(edited.cells[0], batch_size=2),) + edited.cells[1:]
  for call in (lambda: sweep_lib.run_sweep(edited, workdir, only=SMOKE_ONLY),
               lambda: sweep_report.aggregate(edited, workdir)):
    with pytest.raises(ValueError, match=r"stack_T32/kda_seed0_lr0.003 \("
                       r"train.batch_size: 4 -> 2"):
      call()
  # ... but where and how often it logs may change.
  edited = sweep.copy_and_resolve_references()
  edited.unlock()
  edited.base.train.log_every = 3
  edited.base.model.kda.backend = "reference"
  assert sweep_lib.run_sweep(edited, workdir, only=SMOKE_ONLY) == []


def test_parity_sweep_runs_variants_and_tabulates_lengths(tmp_path):
  sweep = sweep_parity.get_config("smoke")
  runs = {r.name: r for r in sweep_lib.expand(sweep)}
  assert sorted(runs) == ["parity_T16/kda_negeig_seed0_lr0.003",
                          "parity_T16/kda_seed0_lr0.003"]
  negeig = runs["parity_T16/kda_negeig_seed0_lr0.003"].config
  assert negeig.model.mixer == "kda" and negeig.model.kda.allow_neg_eigval
  assert not runs["parity_T16/kda_seed0_lr0.003"].config.model.kda[
      "allow_neg_eigval"]
  workdir = str(tmp_path)
  # Trains the variant only: the plain kda run is the smoke sweep's business.
  sweep_lib.run_sweep(sweep, workdir, only="kda_negeig")
  results = sweep_report.aggregate(sweep, workdir)
  assert [c["mixer"] for c in results["cells"]] == ["kda_negeig"]
  for cell in results["cells"]:
    with open(os.path.join(workdir, f"parity_T16/{cell['mixer']}_seed0_lr"
                           "0.003", "summary.json")) as f:
      want = json.load(f)["length_accuracy"]
    got = cell["length_accuracy"]
    assert sorted(got) == ["16", "40"]
    for n in want:
      assert got[n]["mean"] == got[n]["min"] == pytest.approx(want[n])
  with open(os.path.join(workdir, "results.md")) as f:
    md = f.read()
  assert "## Length generalisation" in md and "| T=40 |" in md
  assert "| parity | 16 | kda_negeig | 1 |" in md
  assert os.path.isfile(os.path.join(workdir, "length_generalisation.png"))
  bad = sweep_parity.get_config("smoke")
  bad.variants = {"kda_negeig": (("model.kda.allow_neg_eigval", True),)}
  with pytest.raises(ValueError, match="model.mixer"):
    sweep_lib.expand(bad)
  bad.variants = {"kda_negeig": (("model.mixer", "kda"),
                                 ("model.kda.allow_neg_eigvl", True))}
  with pytest.raises(ValueError, match="allow_neg_eigvl"):
    sweep_lib.expand(bad)


def _fake_run(workdir, name, best, steps_to_99=None, error=None):
  run_dir = os.path.join(workdir, name)
  os.makedirs(run_dir)
  evals = [dict(step=0, split="eval", accuracy=0.0),
           dict(step=25, split="eval", accuracy=best)]
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in evals)
  if error:
    with open(os.path.join(run_dir, "error.json"), "w") as f:
      json.dump(dict(error=error), f)
    return
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(dict(best_eval_accuracy=best, steps_to_99=steps_to_99,
                   chance_accuracy=0.25, wall_seconds=10.0), f)


def test_aggregate_picks_the_best_learning_rate_and_counts_divergence(
    tmp_path):
  sweep = kimi_synthetic.get_config("smoke").copy_and_resolve_references()
  sweep.unlock()
  sweep.learning_rates = (1e-3, 3e-3)
  sweep.mixers = ("kda",)
  sweep.ablation = {}
  workdir = str(tmp_path)
  cell = "palindrome_T16"
  _fake_run(workdir, f"{cell}/kda_seed0_lr0.001", 0.5)
  _fake_run(workdir, f"{cell}/kda_seed1_lr0.001", 0.7)
  _fake_run(workdir, f"{cell}/kda_seed0_lr0.003", 1.0, steps_to_99=25)
  _fake_run(workdir, f"{cell}/kda_seed1_lr0.003", 0.3, error="diverged")
  results = sweep_report.aggregate(sweep, workdir)
  (rec,) = results["cells"]
  # Mean best accuracy: 0.6 at 1e-3, 0.65 at 3e-3 (the diverged run's best).
  assert rec["learning_rate"] == 3e-3
  assert rec["best_accuracy"] == dict(mean=pytest.approx(0.65), min=0.3,
                                      max=1.0)
  assert rec["num_reached_99"] == 1 and rec["num_diverged"] == 1
  assert rec["steps_to_99"]["mean"] == 25
  # A cell on a length curriculum says so beside its step cap.
  _fake_run(workdir, "palindrome_T32/kda_seed0_lr0.001", 0.4)
  results = sweep_report.aggregate(sweep, workdir)
  assert [r["length_curriculum"] for r in results["cells"]] == [[], [[2, 16]]]
  with open(os.path.join(workdir, "results.md")) as f:
    assert "| 4 (2 at T=16 first) |" in f.read()
  # Seeds extended to different caps show the range.
  name = "palindrome_T32/kda_seed1_lr0.001"
  run_dir = os.path.join(workdir, name)
  _fake_run(workdir, name, 0.5)
  (run,) = [r for r in sweep_lib.expand(sweep) if r.name == name]
  config = run.config.to_dict()
  config["train"]["num_steps"] = 9
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(config, f)
  sweep_report.aggregate(sweep, workdir)
  with open(os.path.join(workdir, "results.md")) as f:
    assert "| 4-9 (2 at T=16 first) |" in f.read()


def _reaggregate_committed(name, sweep, tmp_path, readme_table):
  """Aggregates a copy of results/<name>'s runs; checks that results.md (all
  but the aggregating commit, which the copy lacks) is the committed one and
  that the README holds its table starting with `readme_table`. Returns the
  aggregate and the fresh results.md."""
  src = os.path.join(REPO, "results", name)
  workdir = str(tmp_path / name)
  shutil.copytree(src, workdir, ignore=shutil.ignore_patterns(
      "checkpoints", "*.png", "results.*"))
  results = sweep_report.aggregate(sweep, workdir)
  def body(path):
    with open(path) as f:
      text = f.read()
    return text[text.index("Runs trained at:"):]
  fresh = body(os.path.join(workdir, "results.md"))
  assert body(os.path.join(src, "results.md")) == fresh
  table = fresh[fresh.index(readme_table):]
  table = table[:table.index("\n\n")]
  with open(os.path.join(REPO, "README.md")) as f:
    assert table in f.read()
  return results, fresh


def test_the_committed_kimi_results_are_their_runs_aggregate(tmp_path):
  """results.md and the README's table are what the committed runs give."""
  results, fresh = _reaggregate_committed(
      "kimi_synthetic", kimi_synthetic.get_config(), tmp_path,
      "| task | T | chance %")
  # The protocol's rule: a run stops solved or plateaued, or rising only at
  # a cap of MAX_STEPS or more; results.md names every run still rising
  # below it (the extensions still to run).
  assert results["num_finished"] == results["num_runs"]
  below = [run["name"] for run in results["runs"]
           if run["status"] == "rising at cap"
           and run["num_steps"] < kimi_synthetic.MAX_STEPS]
  if below:
    listed = fresh[fresh.index("Still learning below the protocol's cap of"
                               f" {kimi_synthetic.MAX_STEPS} steps"):]
    listed = listed[:listed.index("\n")]
    assert f": {len(below)} runs: " in listed
    for name in below:
      assert name in listed, name


def test_the_committed_recall_profiles_are_of_the_committed_runs():
  """Each profile in recall_vs_lag.json is of its run's final parameters: a
  run extended or retrained after it was profiled needs profiling again."""
  src = os.path.join(REPO, "results", "kimi_synthetic")
  with open(os.path.join(src, "recall_vs_lag.json")) as f:
    profiles = json.load(f)["runs"]
  assert profiles
  for name, profile in profiles.items():
    with open(os.path.join(src, name, "summary.json")) as f:
      steps = json.load(f)["steps"]
    assert profile["step"] == steps, name


def test_the_committed_text_results_are_their_runs_aggregate(tmp_path):
  """results/text/results.md and the README's bits-per-byte table are what
  the committed runs give."""
  from configs.sweeps import text as text_sweep
  _reaggregate_committed("text", text_sweep.get_config(), tmp_path,
                         "| task | T trained | mixer | parameters")


def test_a_cell_can_set_its_own_learning_rates():
  sweep = kimi_synthetic.get_config("smoke").copy_and_resolve_references()
  sweep.unlock()
  cells = [dict(c) for c in sweep.cells]
  cells[1]["learning_rates"] = dict(kda=(5e-4,), attention=(1e-3, 2e-3))
  sweep.cells = tuple(cells)
  sweep.ablation = dict(mixer="kda_zeroed", seq_len=16, seeds=(0,))
  rates = {}
  for run in sweep_lib.expand(sweep):
    assert run.config.train.learning_rate == run.learning_rate
    rates.setdefault((run.task, run.seq_len, run.mixer), set()).add(
        run.learning_rate)
  assert rates[("palindrome", 16, "kda")] == {5e-4}
  assert rates[("palindrome", 16, "attention")] == {1e-3, 2e-3}
  assert rates[("palindrome", 16, "kda_zeroed")] == {5e-4}  # kda's, here
  assert rates[("stack", 32, "kda")] == {3e-3}  # the sweep's elsewhere
  assert rates[("palindrome", 32, "attention")] == {3e-3}
  cells[1]["learning_rates"] = dict(kda=(5e-4,))
  sweep.cells = tuple(cells)
  with pytest.raises(ValueError, match=r"sweep.cells\[1\]\['learning_rates'\]"
                     r" must give rates for every mixer; missing \['attention'\]"):
    sweep_lib.expand(sweep)


def test_sweep_cli_lists_runs(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.sweep",
       "--config=configs/sweeps/kimi_synthetic.py:smoke",
       f"--workdir={tmp_path}", "--list", "--only=palindrome_T32/"],
      cwd=REPO, capture_output=True, text=True, check=True,
      env=_cpu_env()).stdout
  lines = out.strip().splitlines()
  assert len(lines) == 4 and all(l.startswith("todo  palindrome_T32/")
                                 for l in lines)


def test_sweep_cli_lists_where_each_run_stands(tmp_path):
  cell = tmp_path / "palindrome_T32"
  evals = [dict(step=0, split="eval", accuracy=0.25),
           dict(step=2, split="eval", accuracy=0.5),
           dict(step=4, split="eval", accuracy=0.375)]
  for run in ("kda_seed0", "kda_seed1", "attention_seed0"):
    (cell / f"{run}_lr0.003").mkdir(parents=True)
    (cell / f"{run}_lr0.003" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in evals))
  (cell / "kda_seed0_lr0.003" / "summary.json").write_text(json.dumps(
      dict(steps=4, best_eval_accuracy=0.5, status="plateaued")))
  # A live owner (this process) holds kda_seed1; attention_seed0's owner is
  # gone (killed between checkpoints); attention_seed1 never started.
  (cell / "kda_seed1_lr0.003.lock").write_text(json.dumps(
      dict(host=socket.gethostname(), pid=os.getpid())))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.sweep",
       "--config=configs/sweeps/kimi_synthetic.py:smoke",
       f"--workdir={tmp_path}", "--list", "--only=palindrome_T32/"],
      cwd=REPO, capture_output=True, text=True, check=True,
      env=_cpu_env()).stdout
  where = "step 4: held-out 37.5% (best 50.0%)"
  assert out.strip().splitlines() == [
      f"done  palindrome_T32/kda_seed0_lr0.003  {where}, plateaued",
      f"todo  palindrome_T32/attention_seed0_lr0.003  {where}, stopped",
      f"todo  palindrome_T32/kda_seed1_lr0.003  {where}, training",
      "todo  palindrome_T32/attention_seed1_lr0.003",
  ]
