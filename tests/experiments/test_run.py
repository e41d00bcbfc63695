"""End to end: smoke runs of every mixer, checkpoint/resume, CLIs, ablation.

The smoke configs train a tiny model for a few steps; the point is the
plumbing (files, resume, flags, backends), not accuracy.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import common as config_lib
from configs import delayed_copy
from configs import mqar
from configs import parity
from experiments import tasks as tasks_lib
from experiments.sweeps import ablate
from experiments.training import resume
from experiments.training import train
from tests import devices as test_devices
from tests.experiments import argmax_ties

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SUMMARY_KEYS = {"task", "mixer", "backend", "seed", "steps",
                "final_eval_accuracy", "best_eval_accuracy", "chance_accuracy",
                "wall_seconds", "steps_per_second"}
SCORES = ("loss", "accuracy")  # deterministic fields of a metrics record


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _scores(workdir):
  return [(r["step"], r["split"], *(r[k] for k in SCORES))
          for r in _records(workdir)]


def _smoke(mixer, get_config=mqar.get_config):
  return config_lib.apply_diff(get_config("smoke"), {"model.mixer": mixer})


def test_smoke_run_writes_the_workdir_and_resumes_when_done(tmp_path):
  # The workdir contract is the mixer's no more than the data's: one mixer
  # (every mixer's forward is in test_model.py, training in test_sweep.py).
  mixer = "kda"
  config = _smoke(mixer)
  workdir = str(tmp_path / mixer)
  summary = train.train_and_evaluate(config, workdir)
  assert SUMMARY_KEYS <= set(summary)
  n = config.train.num_steps
  assert summary["steps"] == n and summary["mixer"] == mixer
  assert summary["backend"] == "chunked"  # the op's answer on a CPU host
  assert summary["chance_accuracy"] == pytest.approx(1 / 16)
  for name in ("config.json", "metrics.jsonl", "summary.json",
               "accuracy.png"):
    assert os.path.isfile(os.path.join(workdir, name)), name
  assert any(f.startswith("events") for f in os.listdir(
      os.path.join(workdir, "tb")))
  assert str(n) in os.listdir(os.path.join(workdir, "checkpoints"))
  with open(os.path.join(workdir, "accuracy.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  records = _records(workdir)
  evals = [r for r in records if r["split"] == "eval"]
  trains = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in evals] == list(
      range(0, n + 1, config.train.eval_every))
  assert [r["step"] for r in trains] == list(range(1, n + 1))
  for r in trains:
    assert r["steps_per_second"] > 0 and r["tokens_per_second"] > 0
  # exact: the summary copies these from the eval records.
  assert summary["final_eval_accuracy"] == evals[-1]["accuracy"]
  assert summary["best_eval_accuracy"] == max(r["accuracy"] for r in evals)
  # A finished workdir is not retrained: the same summary comes back.
  again = train.train_and_evaluate(config, workdir)
  # exact: the stored summary and records read back, nothing recomputed.
  assert again == json.loads(json.dumps(summary))
  assert _records(workdir) == records


def test_killed_run_resumes_to_the_same_metrics(tmp_path):
  config = _smoke("kda")
  n, every = config.train.num_steps, config.train.checkpoint_every
  stop = n - 1  # not a checkpoint step: the run loses the steps after it
  assert stop % every and stop > every
  train.train_and_evaluate(config, str(tmp_path / "straight"))
  killed = str(tmp_path / "killed")
  train.train_and_evaluate(config, killed, stop_at_step=stop)
  assert not os.path.exists(os.path.join(killed, "summary.json"))
  assert max(r["step"] for r in _records(killed)) == stop
  # Another config does not resume this run's checkpoint, and leaves it be.
  before = _records(killed)
  other = config_lib.apply_diff(config, {"train.learning_rate": 1e-3})
  with pytest.raises(ValueError, match=r"train.learning_rate: 0.003 -> 0.001"):
    train.train_and_evaluate(other, killed)
  assert _records(killed) == before
  # A field the stored config lacks (older code) ran as its default: a
  # difference only where the new config sets another value. The backend
  # and the logging interval may change.
  path = os.path.join(killed, "config.json")
  with open(path) as f:
    stored = json.load(f)
  del stored["train"]["eval_lengths"]
  del stored["train"]["length_curriculum"]
  with open(path, "w") as f:
    json.dump(stored, f)
  moved = config_lib.apply_diff(config, {"model.kda.backend": "reference",
                                         "train.log_every": 5})
  assert resume.config_differences(killed, moved) == []
  staged = config_lib.apply_diff(config,
                                 {"train.length_curriculum": ((2, 32),)})
  assert resume.config_differences(killed, staged) == [
      "train.length_curriculum: absent (ran as []) -> [[2, 32]]"]
  summary = train.train_and_evaluate(config, killed)
  assert summary["steps_trained_this_run"] == n - (stop // every) * every
  # exact: the same compiled steps on the checkpoint's bits and the same
  # batches (a pure function of seed and step) as the uninterrupted run.
  assert _scores(killed) == _scores(str(tmp_path / "straight"))


def test_delayed_copy_smoke_and_config_variants(tmp_path):
  summary = train.train_and_evaluate(_smoke("kda", delayed_copy.get_config),
                                     str(tmp_path))
  assert summary["task"] == "delayed_copy"
  assert summary["chance_accuracy"] == pytest.approx(1 / 8)
  long = delayed_copy.get_config("long")
  assert long.task.delay >= 256
  with pytest.raises(ValueError, match="variant"):
    delayed_copy.get_config("lng")
  with pytest.raises(ValueError, match="variant"):
    mqar.get_config("smok")


@pytest.mark.slow
def test_bfloat16_mixed_precision_tracks_float32(tmp_path):
  runs = {}
  for dtype in ("float32", "bfloat16"):
    config = config_lib.apply_diff(mqar.get_config("smoke"),
                                   {"model.compute_dtype": dtype})
    train.train_and_evaluate(config, str(tmp_path / dtype))
    runs[dtype] = [r for r in _records(str(tmp_path / dtype))
                   if r["split"] == "train"]
    prog = train.build_program(config)
    params = prog.init(jax.random.key(0), np.zeros((1, 8), np.int32))
    assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype("float32")}
    logits = prog.model.apply(params, np.zeros((1, 8), np.int32))
    assert logits.dtype == np.float32  # the loss is computed in float32
  for lo, hi in zip(runs["bfloat16"], runs["float32"]):
    assert lo["loss"] == pytest.approx(hi["loss"], rel=2e-2), (lo, hi)
  with pytest.raises(ValueError, match="model.compute_dtype"):
    train.train_and_evaluate(config_lib.apply_diff(
        mqar.get_config("smoke"), {"model.compute_dtype": "float16"}),
        str(tmp_path / "bad"))


def test_length_generalisation_evaluates_the_final_parameters(tmp_path):
  config = config_lib.apply_diff(parity.get_config("smoke"),
                                 {"model.kda.allow_neg_eigval": True})
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["task"] == "parity" and summary["chance_accuracy"] == 0.5
  acc = summary["length_accuracy"]
  assert sorted(acc) == ["16", "40"]
  # At the training length the set is the held-out set of the last eval.
  assert acc["16"] == pytest.approx(summary["final_eval_accuracy"])
  assert 0.0 <= acc["40"] <= 1.0
  with open(os.path.join(tmp_path, "summary.json")) as f:
    assert json.load(f)["length_accuracy"] == acc


@pytest.mark.slow
def test_length_curriculum_trains_other_lengths_first_and_resumes(tmp_path):
  # The softmax baseline: the curriculum does not depend on the mixer, and
  # it compiles in a fraction of KDA's time.
  config = config_lib.apply_diff(_smoke("attention"), {
      "train.length_curriculum": ((3, 32),)})
  task = train.build_program(config).task
  batches = train.train_batches(config, task)
  # Steps 1-3 (0-based 0-2) draw 8 MQAR sequences of 32 tokens from the
  # training stream, the same 256 tokens a step; then the task's 4 x 64.
  for step in range(config.train.num_steps):
    batch = batches(step)
    want = (8, 32) if step < 3 else (4, 64)
    assert batch["inputs"].shape == want, step
    stage = tasks_lib.make_task(**dict(config.task.to_dict(),
                                       seq_len=want[1]))
    drawn = stage.sample(tasks_lib.rng(0, tasks_lib.TRAIN_STREAM, step),
                         want[0]).as_dict()
    for name in drawn:  # exact: the same NumPy draw from the same seed
      np.testing.assert_array_equal(batch[name], drawn[name])
  # A stage at the task's own length draws the batches of no curriculum.
  same = train.train_batches(config_lib.apply_diff(
      config, {"train.length_curriculum": ((3, 64),)}), task)
  plain = train.train_batches(_smoke("attention"), task)
  for step in range(config.train.num_steps):
    for name, x in plain(step).items():  # exact: the same NumPy draw
      np.testing.assert_array_equal(same(step)[name], x)
  train.train_and_evaluate(_smoke("attention"), str(tmp_path / "plain"))
  # Killed at step 3 (checkpoint at 2), it resumes inside the stage and
  # crosses into the task's length as the uninterrupted run did.
  straight = train.train_and_evaluate(config, str(tmp_path / "straight"))
  killed = str(tmp_path / "killed")
  train.train_and_evaluate(config, killed, stop_at_step=3)
  train.train_and_evaluate(config, killed)
  # exact: resumed, the same compiled steps on the checkpoint's bits.
  assert _scores(killed) == _scores(str(tmp_path / "straight"))
  assert straight["seq_len"] == 64
  # The held-out set stays at the task's length: step 0 is the plain run's.
  # exact: the curriculum changes only the training batches; the step-0
  # eval is the same HLO on the same initial parameters and held-out set.
  assert _scores(killed)[0] == _scores(str(tmp_path / "plain"))[0]
  assert _scores(killed)[1] != _scores(str(tmp_path / "plain"))[1]
  prog = train.build_program(config)
  params = prog.init(jax.random.key(0), np.zeros((1, 64), np.int32))
  wrong = {k: np.zeros((2, 64), v.dtype) for k, v in batches(0).items()}
  with pytest.raises(ValueError, match="train.length_curriculum"):
    prog.train_step(params, prog.init_opt(params), wrong)


def test_bad_train_values_name_the_field(tmp_path):
  for diff, field in (({"train.learning_rate": -1.0}, "train.learning_rate"),
                      ({"train.warmup_steps": 100}, "train.warmup_steps"),
                      ({"train.batch_size": 0}, "train.batch_size"),
                      ({"train.eval_lengths": (64, 0)},
                       "train.eval_lengths"),
                      # 4 x 64 tokens a step do not split into T=48 rows.
                      ({"train.length_curriculum": ((2, 48),)},
                       "train.length_curriculum"),
                      ({"train.length_curriculum": ((7, 32),)},
                       r"train.length_curriculum must be stages of at most"
                       r" train.num_steps \(6\)"),
                      ({"train.length_curriculum": (32,)},
                       "train.length_curriculum")):
    with pytest.raises(ValueError, match=field):
      train.train_and_evaluate(
          config_lib.apply_diff(mqar.get_config("smoke"), diff),
          str(tmp_path))


@pytest.mark.slow
def test_data_x_context_mesh_gives_the_single_device_run(tmp_path):
  # 2 x 2 mesh on simulated CPU devices (tests/conftest.py): the batch split
  # over "data", the sequence over "context" (KDA state passing and the conv
  # halo across ranks); every logged loss and accuracy matches the 1 x 1
  # run's (losses to rounding, accuracies up to near-ties).
  test_devices.devices(4)  # skips on a single chip (make test-tpu)
  base = config_lib.apply_diff(_smoke("kda"), {
      "model.kda.backend": "reference", "train.num_steps": 3,
      "train.eval_every": 3, "train.checkpoint_every": 3})
  meshed_config = config_lib.apply_diff(base, {"mesh.data": 2,
                                               "mesh.context": 2})
  single = train.train_and_evaluate(base, str(tmp_path / "single"))
  meshed = train.train_and_evaluate(meshed_config, str(tmp_path / "mesh"))
  assert single["mesh"] == [1, 1] and meshed["mesh"] == [2, 2]
  got, want = _scores(str(tmp_path / "mesh")), _scores(str(tmp_path / "single"))
  assert [r[:2] for r in got] == [r[:2] for r in want]
  np.testing.assert_allclose([r[2] for r in got], [r[2] for r in want],
                             rtol=1e-5)
  # Accuracies: the same hits but for positions whose top two logits lie
  # within float32 rounding and the runs' drift (argmax_ties.py); each
  # run's parameters at every step from a rerun of its program.
  traces = []
  for config, scores in ((meshed_config, got), (base, want)):
    trace, losses = argmax_ties.replay(config)
    # exact: the run's own compiled program, run again on the same data.
    assert losses == [r[2] for r in scores if r[1] == "train"]
    traces.append(trace)
  argmax_ties.assert_same_run_accuracies(base, got, want, *traces)


@pytest.mark.parametrize("diff,error,match", [
    ({"mesh.data": 3}, ValueError, "train.batch_size must be a multiple of"
     " mesh.data"),
    ({"mesh.context": 0}, ValueError, "mesh.context must be an int >= 1"),
    ({"mesh.data": 4, "mesh.context": 4}, ValueError, "number of devices"),
    ({"mesh.context": 3}, ValueError, "task.seq_len must be a multiple of"
     " mesh.context"),
    ({"mesh.context": 2, "model.mixer": "attention"}, NotImplementedError,
     "no context parallelism"),
    ({"mesh.context": 2, "model.mixer": "kda,attention",
      "model.num_layers": 2}, NotImplementedError,
     "has a layer of mixer 'attention'"),
])
def test_bad_mesh_values_name_the_field(tmp_path, diff, error, match):
  with pytest.raises(error, match=match):
    train.train_and_evaluate(
        config_lib.apply_diff(mqar.get_config("smoke"), diff), str(tmp_path))


def test_a_mesh_the_task_cannot_split_is_refused_before_any_mesh():
  # The config's own mistake, named whatever devices the host has: the
  # check runs before `make_mesh` compares the mesh with them (on one TPU
  # chip that came first, naming the device count instead).
  config = config_lib.apply_diff(mqar.get_config("smoke"),
                                 {"mesh.context": 3})
  with pytest.raises(ValueError, match="task.seq_len must be a multiple of"
                     r" mesh.context \(3\); got 64"):
    train.validate_config(config)


def test_ablation_writes_a_table_and_a_plot(tmp_path):
  summaries, table = ablate.run_ablation(
      mqar.get_config("smoke"), str(tmp_path), ["none", "attention"],
      seeds=[0], learning_rates=[1e-3])
  assert [s["mixer"] for s in summaries] == ["none", "attention"]
  with open(tmp_path / "results.md") as f:
    text = f.read()
  assert table in text
  rows = [line for line in table.splitlines()[2:]]
  assert len(rows) == 2 and rows[0].startswith("| none | 0.001 | 0 |")
  assert os.path.isfile(tmp_path / "accuracy.png")
  assert os.path.isdir(tmp_path / "attention_seed0_lr0.001")
  with pytest.raises(ValueError, match="--mixers"):
    ablate.run_ablation(mqar.get_config("smoke"), str(tmp_path), ["kdaa"],
                        seeds=[0], learning_rates=[1e-3])


def _cli(*args, timeout=600):
  return subprocess.run(
      [sys.executable, os.path.join(REPO, "run_experiment.py"),
       "--compilation_cache_dir=", *args],  # nothing written under ~/.cache
      cwd=REPO, capture_output=True, text=True, timeout=timeout,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli_rejects_a_misspelt_override(tmp_path):
  result = _cli("--config=configs/mqar.py:smoke", f"--workdir={tmp_path}",
                "--config.model.mixxer=kda")
  assert result.returncode != 0
  assert "mixxer" in result.stderr
  assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.slow
def test_cli_mosaic_backend_runs_in_interpret_mode(tmp_path):
  result = _cli("--config=configs/mqar.py:smoke", f"--workdir={tmp_path}",
                "--config.model.kda.backend=mosaic",
                "--config.train.num_steps=1", "--config.train.warmup_steps=0",
                "--config.train.eval_every=1", "--alsologtostderr")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "interpret.interpret_mode" in result.stderr
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  # The resolved name: "mosaic" is the old name of "tokamax"; the run's
  # config.json records the new one.
  assert summary["backend"] == "tokamax" and summary["steps"] == 1
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["model"]["kda"]["backend"] == "tokamax"
  assert summary["seq_len"] % 64 == 0


def test_divergence_names_its_step_whatever_the_log_interval(tmp_path):
  # A rate of 1e30 sends the parameters to ~1e30 after one step; the next
  # forward overflows. The loop syncs with the device only every log_every
  # steps, yet names the step the gradients went non-finite.
  messages = set()
  for log_every in (1, 5):
    config = config_lib.apply_diff(_smoke("none"), {
        "train.learning_rate": 1e30, "train.warmup_steps": 0,
        "train.log_every": log_every, "train.eval_every": 5,
        "train.checkpoint_every": 5})
    with pytest.raises(FloatingPointError,
                       match=r"Non-finite gradients at step \d") as e:
      train.train_and_evaluate(config, str(tmp_path / str(log_every)))
    messages.add(str(e.value))
    # Nothing past the divergence was saved.
    assert not os.path.exists(tmp_path / str(log_every) / "checkpoints" / "5")
  assert len(messages) == 1, messages
