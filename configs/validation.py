"""The checks of an experiment config: every field and its allowed range.

One place for them (`validate_config`), so every message reads the same:
"<field> must be <what it accepts>; got <value>.". Plain Python on a
ConfigDict: this package imports no numerics.

The names the code defines (registered mixers, status rules, the tasks
whose held-out windows can be cut) come in as a `Vocabulary` from the
program (`experiments.training.program.validate_config`), which then runs the
checks that need the code: each mixer's own argument checks
(`linear_attention.modules`) and what its capabilities allow on the mesh.
"""

import math
from typing import Any, NamedTuple

import ml_collections

SCHEDULES = ("cosine", "constant", "wsd")  # train.schedule
COMPUTE_DTYPES = ("float32", "bfloat16")  # model.compute_dtype
# model.precision: the names of linear_attention/ops/precision.py (a test
# keeps the two equal; configs import no numerics).
PRECISIONS = ("auto", "highest", "high", "default")


class Vocabulary(NamedTuple):
  """The names the code behind a config defines."""

  mixers: tuple[str, ...]  # model.mixer: registered names, "none" included
  status_rules: tuple[str, ...]  # train.status_rule
  stream_tasks: tuple[str, ...]  # tasks whose windows can be cut shorter


def decay_start(tr) -> int | None:
  """The step at which a "wsd" schedule starts its decay; None otherwise."""
  if tr.get("schedule", "cosine") != "wsd":
    return None
  return tr.num_steps - round(tr.decay_fraction * tr.num_steps)


def mixer_pattern(model, mixers) -> tuple[str, ...]:
  """The mixer of each layer: `model.mixer` is one name of `mixers`, or a
  comma-separated pattern of them repeated over `model.num_layers` (e.g.
  "kda,kda,kda,attention": Kimi Linear's 3:1 hybrid)."""
  pattern = tuple(m.strip() for m in str(model.mixer).split(","))
  check("model.mixer", all(m in mixers for m in pattern),
        f"one of {list(mixers)} or a comma-separated pattern of them",
        model.mixer)
  if model.num_layers % len(pattern):
    raise ValueError(
        f"model.num_layers ({model.num_layers}) must be a multiple of the"
        f" length of the mixer pattern {model.mixer!r} ({len(pattern)}).")
  return pattern * (model.num_layers // len(pattern))


def validate_model(model, mixers) -> None:
  """The checks of `config.model` that need no code (each mixer's own
  section is checked by the mixer)."""
  for field in ("num_layers", "d_model", "mlp_hidden"):
    check(f"model.{field}", is_int(model[field]) and model[field] >= 1,
          "an int >= 1", model[field])
  mixer_pattern(model, mixers)
  dtype = model.get("compute_dtype", "float32")
  check("model.compute_dtype", dtype in COMPUTE_DTYPES,
        f"one of {COMPUTE_DTYPES}", dtype)
  precision = model.get("precision", "auto")
  check("model.precision", precision in PRECISIONS, f"one of {PRECISIONS}",
        precision)


def check(name: str, ok: bool, want: str, value: Any) -> None:
  """ValueError "<name> must be <want>; got <value>." unless `ok`."""
  if not ok:
    raise ValueError(f"{name} must be {want}; got {value!r}.")


def is_int(x) -> bool:
  """An int, not a bool."""
  return isinstance(x, int) and not isinstance(x, bool)


def validate_config(config: ml_collections.ConfigDict,
                    vocabulary: Vocabulary) -> None:
  """Raises ValueError naming the first bad field of `config`.

  Every field a config file sets (sections, seed, train, mesh, model) with
  its allowed range; the names the code defines come in `vocabulary`.
  """
  if "task" not in config and {"base", "cells"} <= set(config):
    raise ValueError(
        "the config is a sweep config (a base config crossed with its"
        " cells, configs/sweeps/), not one experiment: give it to the sweep"
        " command, experiments.sweep, or give one experiment config"
        " (configs/*.py).")
  for section in ("task", "model", "train"):
    check(section, section in config, "a section of the config", None)
  check("seed", is_int(config.seed) and config.seed >= 0, "an int >= 0",
        config.seed)
  tr = config.train
  for field, low in (("num_steps", 1), ("batch_size", 1), ("log_every", 1),
                     ("eval_every", 1), ("eval_batches", 1),
                     ("eval_batch_size", 1), ("checkpoint_every", 1),
                     ("warmup_steps", 0)):
    check(f"train.{field}", is_int(tr[field]) and tr[field] >= low,
          f"an int >= {low}", tr[field])
  for field in ("learning_rate", "grad_clip"):
    check(f"train.{field}",
          isinstance(tr[field], (int, float)) and tr[field] > 0
          and math.isfinite(tr[field]), "a positive number", tr[field])
  check("train.weight_decay",
        isinstance(tr.weight_decay, (int, float)) and tr.weight_decay >= 0
        and math.isfinite(tr.weight_decay), "a finite number >= 0",
        tr.weight_decay)
  for field in ("b1", "b2"):  # Adam's moment decays
    check(f"train.{field}", isinstance(tr[field], (int, float))
          and 0 <= tr[field] < 1, "in [0, 1)", tr[field])
  check("train.final_lr_fraction",
        isinstance(tr.final_lr_fraction, (int, float))
        and 0 <= tr.final_lr_fraction <= 1, "in [0, 1]", tr.final_lr_fraction)
  schedule = tr.get("schedule", "cosine")
  check("train.schedule", schedule in SCHEDULES, f"one of {SCHEDULES}",
        schedule)
  if schedule == "wsd":
    fraction = tr.decay_fraction
    check("train.decay_fraction", isinstance(fraction, (int, float))
          and 0 < fraction <= 1, "in (0, 1]", fraction)
    check("train.decay_fraction", decay_start(tr) >= tr.warmup_steps,
          f"small enough that the decay starts after train.warmup_steps"
          f" ({tr.warmup_steps}) of train.num_steps ({tr.num_steps})",
          fraction)
  check("train.stop_at_accuracy", tr.stop_at_accuracy is None or (
      0 < tr.stop_at_accuracy <= 1), "None or in (0, 1]", tr.stop_at_accuracy)
  check("train.warmup_steps", tr.warmup_steps < tr.num_steps,
        f"< train.num_steps ({tr.num_steps})", tr.warmup_steps)
  lengths = tr.get("eval_lengths", ())
  check("train.eval_lengths",
        isinstance(lengths, (tuple, list))
        and all(is_int(n) and n >= 1 for n in lengths),
        "a tuple of ints >= 1", lengths)
  check("train.eval_lengths", not lengths or "seq_len" in config.task,
        "empty for a task without a seq_len field", lengths)
  rule = tr.get("status_rule", "accuracy")
  check("train.status_rule", rule in vocabulary.status_rules,
        f"one of {vocabulary.status_rules}", rule)
  check_score_last(config, vocabulary)
  check("mesh", "mesh" in config, "a section of the config", None)
  for field in ("data", "context"):
    value = config.mesh[field]
    check(f"mesh.{field}", is_int(value) and value >= 1, "an int >= 1",
          value)
  check_curriculum(config)
  for field in ("batch_size", "eval_batch_size"):
    check(f"train.{field}", tr[field] % config.mesh.data == 0,
          f"a multiple of mesh.data ({config.mesh.data})", tr[field])
  validate_model(config.model, vocabulary.mixers)


def check_score_last(config, vocabulary: Vocabulary) -> None:
  """The checks of `train.eval_score_last` (see configs/common.py)."""
  tr = config.train
  score_last = tr.get("eval_score_last")
  if score_last is None:
    return
  name = "train.eval_score_last"
  check(name, config.task.get("name") in vocabulary.stream_tasks,
        "None for a task whose windows cannot be cut shorter (only a stream"
        " task such as text has `cut`)", score_last)
  shortest = min([config.task.seq_len, *tr.get("eval_lengths", ())])
  check(name, is_int(score_last) and 1 <= score_last <= shortest,
        f"None or an int in [1, {shortest}] (task.seq_len and every"
        " train.eval_lengths are at least that long)", score_last)


def check_curriculum(config) -> None:
  """The checks of `train.length_curriculum` (see configs/common.py)."""
  tr = config.train
  stages = tr.get("length_curriculum", ())
  name = "train.length_curriculum"
  check(name, isinstance(stages, (tuple, list)) and all(
      isinstance(st, (tuple, list)) and len(st) == 2
      and all(is_int(n) and n >= 1 for n in st) for st in stages),
        "a tuple of (steps, seq_len) pairs of ints >= 1", stages)
  if not stages:
    return
  check(name, "seq_len" in config.task, "empty for a task without a seq_len"
        " field", stages)
  total = sum(steps for steps, _ in stages)
  check(name, total <= tr.num_steps,
        f"stages of at most train.num_steps ({tr.num_steps}) steps in all",
        stages)
  tokens = tr.batch_size * config.task.seq_len
  for _, seq_len in stages:
    check(name, tokens % seq_len == 0 and (tokens // seq_len)
          % config.mesh.data == 0,
          f"stages whose seq_len divides train.batch_size x task.seq_len"
          f" ({tokens} tokens a step) into a multiple of mesh.data"
          f" ({config.mesh.data}) sequences", stages)
    check(name, seq_len % config.mesh.context == 0,
          f"stages whose seq_len is a multiple of mesh.context"
          f" ({config.mesh.context})", stages)
