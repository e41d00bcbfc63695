"""Learning-rate schedules, extendable runs and the run status."""

import json
import math
import os

import numpy as np
import pytest

from configs import common as config_lib
from configs import mqar
from experiments.training import metrics as metrics_lib
from experiments.training import program as program_lib
from experiments.training import train


def _tr(schedule, **overrides):
  return config_lib.train_config(schedule=schedule, num_steps=100,
                                 warmup_steps=10, learning_rate=2.0,
                                 final_lr_fraction=0.1, **overrides)


def test_schedules_follow_their_formulas():
  peak, end = 2.0, 0.2
  cosine = program_lib.make_schedule(_tr("cosine"))
  constant = program_lib.make_schedule(_tr("constant"))
  wsd = program_lib.make_schedule(_tr("wsd", decay_fraction=0.3))
  for step in range(0, 10):  # the same linear warm-up for all three
    for f in (cosine, constant, wsd):
      assert float(f(step)) == pytest.approx(peak * step / 10)
  for step in range(10, 130, 7):
    frac = min(step - 10, 90) / 90
    assert float(cosine(step)) == pytest.approx(
        end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac)), rel=1e-5)
    assert float(constant(step)) == pytest.approx(peak)
    decay = min(max(step - 70, 0), 30) / 30  # the last 30 of 100 steps
    assert float(wsd(step)) == pytest.approx(peak + (end - peak) * decay,
                                             rel=1e-5)
  assert program_lib.decay_start(_tr("wsd", decay_fraction=0.3)) == 70
  assert program_lib.decay_start(_tr("constant")) is None


@pytest.mark.parametrize("diff, match", [
    ({"train.schedule": "linear"}, "train.schedule must be one of"),
    ({"train.schedule": "wsd", "train.decay_fraction": 0.0},
     r"train.decay_fraction must be in \(0, 1\]"),
    ({"train.schedule": "wsd", "train.decay_fraction": 1.0},
     "train.decay_fraction must be small enough"),
])
def test_bad_schedule_fields_name_the_field(diff, match, tmp_path):
  config = config_lib.apply_diff(mqar.get_config("smoke"), diff)
  with pytest.raises(ValueError, match=match):
    train.train_and_evaluate(config, str(tmp_path))


def _config(schedule, num_steps, **diff):
  # The MLP-only model: the point is the schedule and the workdir, and it
  # compiles in a fraction of KDA's time.
  return config_lib.apply_diff(mqar.get_config("smoke"), {
      "model.mixer": "none", "train.schedule": schedule,
      "train.num_steps": num_steps, "train.stop_at_accuracy": None, **diff})


def _scores(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["split"], r["loss"], r["accuracy"],
             r.get("learning_rate")) for r in map(json.loads, f)]


def test_constant_run_extended_to_twice_its_steps_is_the_longer_run(tmp_path):
  straight, extended = str(tmp_path / "straight"), str(tmp_path / "extended")
  train.train_and_evaluate(_config("constant", 12), straight)
  first = train.train_and_evaluate(_config("constant", 6), extended)
  assert first["steps"] == 6 and first["num_steps"] == 6
  # The same num_steps again: finished, nothing retrained.
  assert train.train_and_evaluate(_config("constant", 6), extended) == first
  summary = train.train_and_evaluate(_config("constant", 12), extended)
  assert summary["steps"] == 12 and summary["steps_trained_this_run"] == 6
  # exact: the constant schedule does not read num_steps, so both configs
  # compile the same train step (identical HLO) and the extension resumes it.
  assert _scores(extended) == _scores(straight)
  # A lower cap than the run trained: finished, config.json left as it ran.
  assert train.train_and_evaluate(_config("constant", 6), extended) == (
      json.loads(json.dumps(summary)))
  with open(os.path.join(extended, "config.json")) as f:
    assert json.load(f)["train"]["num_steps"] == 12


def test_wsd_run_extends_from_before_its_decay(tmp_path):
  # 12 steps, decay over the last 3 (from step 9); extended to 24 (decay
  # from 18): steps 10-12 decayed, so the run continues from step 9.
  straight, extended = str(tmp_path / "straight"), str(tmp_path / "extended")
  diff = {"train.decay_fraction": 0.25, "train.checkpoint_every": 2}
  train.train_and_evaluate(_config("wsd", 24, **diff), straight)
  train.train_and_evaluate(_config("wsd", 12, **diff), extended)
  kept = sorted(int(s) for s in os.listdir(os.path.join(extended,
                                                        "checkpoints"))
                if s.isdigit())
  assert kept == [9, 10, 12]  # the last two and the decay start
  summary = train.train_and_evaluate(_config("wsd", 24, **diff), extended)
  assert summary["steps_trained_this_run"] == 24 - 9
  # exact: the two steps' HLO differ only in the decay's constants (start 9
  # vs 18, length 3 vs 6); before step 9 join_schedules' where discards that
  # branch, so steps 1-9 compute the same arithmetic, and from step 9 on
  # both run the 24-step program.
  assert _scores(extended) == _scores(straight)


def test_cosine_run_is_not_extended(tmp_path):
  workdir = str(tmp_path)
  train.train_and_evaluate(_config("cosine", 6), workdir)
  with pytest.raises(ValueError, match=r"train.num_steps: 6 -> 12"):
    train.train_and_evaluate(_config("cosine", 12), workdir)


def _records(evals, rates, every=10):
  """Metrics records: eval (step, accuracy) pairs, train rates per step."""
  out = [dict(step=s, split="train", learning_rate=rates(s), loss=0.0,
              accuracy=0.0, steps_per_second=2.0)
         for s in range(every, max(s for s, _ in evals) + 1, every)]
  out += [dict(step=s, split="eval", accuracy=a, loss=0.0) for s, a in evals]
  return sorted(out, key=lambda r: r["step"])


def test_run_status_calls_a_run_plateaued_only_when_flat():
  flat = lambda s: 1.0
  steps = range(0, 1001, 25)
  status = metrics_lib.run_status
  assert status(_records([(s, 0.3) for s in steps], flat)) == "plateaued"
  # A steady rise of 0.4 points over the last 20% (steps 800-1000): a
  # plateau; 0.6: rising (both measures see it).
  for rise, want in ((0.004, "plateaued"), (0.006, "rising at cap")):
    curve = [(s, 0.3 + rise * s / 200) for s in steps]
    assert status(_records(curve, flat)) == want, rise
  # Each measure alone keeps a run rising. One high evaluation mid-window
  # (the fitted line flat, the best 1 point above the window before):
  spike = [(s, 0.3 + 0.01 * (s == 900)) for s in steps]
  assert status(_records(spike, flat)) == "rising at cap"
  # A fitted rise of 0.8 points over the last 20%, its best still below
  # one high evaluation of the window before:
  ramp = [(s, 0.3 + 0.008 * min(max(s - 800, 0), 200) / 200
           + 0.02 * (s == 700)) for s in steps]
  assert status(_records(ramp, flat)) == "rising at cap"
  # The audit's case: flat by the old 300-step slope, +1 point between the
  # best of the last 20% and the 20% before.
  stairs = [(s, 0.3 + 0.01 * (s >= 850)) for s in steps]
  assert status(_records(stairs, flat)) == "rising at cap"
  assert status(_records([(s, 0.99 * (s == 500)) for s in steps],
                         flat)) == "solved"
  assert status(_records([(s, 0.3) for s in range(0, 101, 25)],
                         flat)) == "rising at cap"  # too few evaluations
  # Rising while the rate was high, flat in a low-rate tail: rising.
  decayed = lambda s: 1.0 if s <= 600 else 0.1
  curve = [(s, 0.1 + 1e-3 * min(s, 600)) for s in steps]
  assert status(_records(curve, decayed)) == "rising at cap"
  # Flat while the rate was high, rising in the low-rate tail: rising too.
  curve = [(s, 0.1 + 1e-3 * max(s - 600, 0)) for s in steps]
  assert status(_records(curve, decayed)) == "rising at cap"
  # Flat in both: plateaued.
  assert status(_records([(s, 0.1) for s in steps], decayed)) == "plateaued"


def _loss_records(bits, last=3000, every=50):
  """Eval records of a held-out loss (nats) whose bits are `bits(step)`."""
  return [dict(step=s, split="eval", accuracy=0.0, loss=bits(s) * np.log(2))
          for s in range(0, last + 1, every)]


def test_loss_status_stops_when_bits_per_byte_stop_falling():
  status = lambda records: metrics_lib.run_status(records, rule="loss")
  # A straight fall of 0.004 bits over the last 10% (steps 2700-3000):
  # converged; 0.006: still falling.
  for fall, want in ((0.004, "converged"), (0.006, "falling at cap")):
    per_step = fall / 300
    assert status(_loss_records(lambda s: 3.0 - per_step * s)) == want, fall
  # Flat since step 1000 at 2.0: converged; the same curve at 1500 steps
  # is too short (at least 2000).
  curve = lambda s: 2.0 + 1e-3 * max(1000 - s, 0)
  assert status(_loss_records(curve)) == "converged"
  assert status(_loss_records(curve, last=1500)) == "falling at cap"
  # Each measure alone keeps a run falling. A fitted line that is flat
  # (one low evaluation mid-window), but the last 10% reaches 0.01 bits
  # below the best of the 10% before:
  dip = lambda s: 2.0 - 0.01 * (s == 2850)
  assert status(_loss_records(dip)) == "falling at cap"
  # A fitted fall of 0.008 over the last 10%, whose lowest point is still
  # above one low evaluation of the 10% before:
  slope = lambda s: 2.0 - 0.008 * min(max(s - 2700, 0), 300) / 300 - (
      0.02 * (s == 2500))
  assert status(_loss_records(slope)) == "falling at cap"
  # Noise about a flat level (+-0.003, alternating) is no fall.
  wiggle = lambda s: 2.0 + 0.003 * (-1) ** (s // 50)
  assert status(_loss_records(wiggle)) == "converged"
  # A loss that rises (overfitting) is not falling.
  assert status(_loss_records(lambda s: 2.0 + 1e-5 * s)) == "converged"
  with pytest.raises(ValueError, match="train.status_rule"):
    metrics_lib.run_status([], rule="bits")


def test_train_seconds_sums_every_logged_window():
  records = [dict(step=10, split="train", steps_per_second=2.0),
             dict(step=10, split="eval", accuracy=0.0),
             dict(step=30, split="train", steps_per_second=4.0)]
  assert metrics_lib.train_seconds(records) == pytest.approx(5.0 + 5.0)


def test_pause_seconds_counts_only_the_stopped_windows():
  window = lambda step, sps: dict(step=step, split="train",
                                  steps_per_second=sps)
  # 10 steps a window at 2 steps/s (5 s); one window stopped for 600 s more.
  records = [window(10 * i, 2.0) for i in range(1, 5)] + [
      window(50, 10 / 605.0)] + [window(10 * i, 2.0) for i in range(6, 10)]
  assert metrics_lib.train_seconds(records) == pytest.approx(8 * 5 + 605)
  assert metrics_lib.pause_seconds(records) == pytest.approx(600)
  # A slow first window (compilation, 4x the pace) is training.
  records[0] = window(10, 0.5)
  assert metrics_lib.pause_seconds(records) == pytest.approx(600)
  assert metrics_lib.pause_seconds([]) == 0.0


def test_metrics_log_drops_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  whole = [dict(step=0, split="eval", accuracy=0.5, loss=1.0),
           dict(step=1, split="train", accuracy=0.5, loss=1.0)]
  text = "".join(json.dumps(r) + "\n" for r in whole)
  path.write_text(text + '{"step": 2, "spl')
  log = metrics_lib.MetricsLog(str(tmp_path), resume_step=5)
  log.close()
  assert log.records == whole
  assert path.read_text() == text  # rewritten without the torn line
  path.write_text('{"step": 0, "spl\n' + text)
  with pytest.raises(ValueError, match="line 1 is not a JSON record"):
    metrics_lib.MetricsLog(str(tmp_path), resume_step=5)
