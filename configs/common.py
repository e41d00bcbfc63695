"""Pieces shared by the experiment config files (configs/mqar.py, ...).

Plain data: this package imports ml_collections only (no JAX), so loading a
config is cheap and a config can be read without the code it configures.

Every experiment config has the same sections:

* `seed`: parameters from `jax.random.key(seed)`; data from (seed, step);
* `task`: `name` plus the task's fields (see `experiments.tasks`);
* `model`: `mixer`, `num_layers`, `d_model`, `mlp_hidden`, `compute_dtype`,
  `precision`, and one section of keywords per mixer family: `kda` (the
  `KimiDeltaAttention` keywords, `configs.layers.kda_config()`; read by the
  mixers "kda", "gdn", "kda_zeroed") and `attention` (the softmax
  baseline's keywords);
* `model.precision` ("auto") is pinned on every matmul of the model; a
  mixer section's `precision` of None follows it (attention's), a name
  overrides it (`model.kda.precision`, "auto"); docs/api.md, "Precision";
* `train`: optimiser, schedule, batch, logging, evaluation, checkpoints;
* `mesh`: `data` x `context` devices; the batch is split over `data` and the
  sequence over `context` (KDA's exact state passing); 1 x 1 is one device.

An ablation is a one-line diff applied to a config with `apply_diff`
(alphafold's CONFIG_DIFFS pattern): `{"model.mixer": "kda_zeroed"}`, with
the mixer names of `linear_attention.modules.registry`. The fields are
checked by `configs.validation`.
"""

import copy
from typing import Any, Mapping

import ml_collections
from ml_collections import config_dict



def kda_config() -> ml_collections.ConfigDict:
  """The KDA layer's keywords, from `configs.layers`."""
  from configs import layers  # pylint: disable=g-import-not-at-top
  return layers.kda_config()


def model_config(*, mixer="kda", num_layers=2, d_model=128, mlp_hidden=256,
                 num_heads=2, head_dim=64, conv_size=4):
  """config.model; the attention baseline mirrors the KDA heads and conv."""
  kda = kda_config()
  kda.num_heads = num_heads
  kda.head_dim = head_dim
  kda.conv_size = conv_size
  return ml_collections.ConfigDict(dict(
      mixer=mixer,  # a name of linear_attention.modules.registry, or a pattern
      num_layers=num_layers,
      d_model=d_model,
      mlp_hidden=mlp_hidden,
      # "bfloat16": mixed precision (float32 parameters and optimizer state,
      # bfloat16 activations and matmuls, float32 KDA state and loss).
      compute_dtype="float32",
      # Matmul precision of the whole model (linear_attention/ops/
      # precision.py): "auto" (HIGHEST for float32 compute, one bfloat16
      # pass for bfloat16), "highest", "high" or "default"; pinned whatever
      # jax.default_matmul_precision says. A section's precision of None
      # is this one.
      precision="auto",
      kda=kda,
      attention=dict(num_heads=num_heads, head_dim=head_dim,
                     conv_size=conv_size, rope_base=10_000.0,
                     rope=True,  # False: no positional encoding (NoPE)
                     # None: model.precision; or a name of its own.
                     precision=config_dict.placeholder(str)),
  ))


def mesh_config(data: int = 1, context: int = 1) -> ml_collections.ConfigDict:
  """config.mesh: devices along the batch (`data`) and the sequence."""
  return ml_collections.ConfigDict(dict(data=data, context=context))


def train_config(**overrides):
  """config.train with defaults; `overrides` must name existing fields."""
  tr = ml_collections.ConfigDict(dict(
      num_steps=500,
      batch_size=64,
      learning_rate=3e-3,  # the peak rate, reached after warmup_steps
      warmup_steps=50,
      # After the linear warm-up: "cosine" decays to learning_rate *
      # final_lr_fraction at num_steps; "constant" holds the peak (a run can
      # be extended by raising num_steps: the steps it trained are the
      # longer run's); "wsd" holds the peak, then decays linearly to
      # learning_rate * final_lr_fraction over the last decay_fraction of
      # num_steps (warm-up, stable, decay).
      schedule="cosine",
      final_lr_fraction=0.1,
      decay_fraction=0.2,  # "wsd" only
      weight_decay=0.1,  # AdamW, on matrices only
      b1=0.9,
      b2=0.98,
      grad_clip=1.0,  # global-norm clipping
      log_every=10,
      eval_every=25,
      eval_batches=4,  # held-out set: eval_batches x eval_batch_size examples
      eval_batch_size=64,
      checkpoint_every=100,
      # Stop once the held-out accuracy reaches this (None: run every step).
      stop_at_accuracy=config_dict.placeholder(float),
      # Length generalisation: after training, the held-out accuracy of the
      # final parameters at each of these sequence lengths (task.seq_len
      # replaced; summary.json `length_accuracy`). () for none.
      eval_lengths=(),
      # Score only the last this many positions of every held-out window,
      # at the training length and at each of eval_lengths, all windows cut
      # from one draw at the longest length so that each length scores the
      # same targets with more context in front (a stream task: text).
      # None: each length draws its own windows and scores every position.
      eval_score_last=config_dict.placeholder(int),
      # How a run's status is read from its metrics
      # (experiments/training/metrics.py run_status): "accuracy" (solved,
      # plateaued, rising at cap) or "loss" (converged, falling at cap: the
      # held-out loss in bits).
      status_rule="accuracy",
      # Length curriculum: ((steps, seq_len), ...) stages trained before the
      # task's own length (task.seq_len replaced), each step holding the same
      # tokens (batch_size * task.seq_len // seq_len sequences); held-out
      # evaluation stays at task.seq_len. () for none.
      length_curriculum=(),
  ))
  for key, value in overrides.items():
    if key not in tr:
      raise ValueError(f"train.{key} is not a field of config.train.")
    tr[key] = value
  return tr


def apply_diff(config: ml_collections.ConfigDict,
               diff: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted fields set; unknown fields raise."""
  config = copy.deepcopy(config)  # keeps the lock and typed references
  for path, value in diff.items():
    *parents, leaf = path.split(".")
    node = config
    for p in parents:
      if p not in node:
        raise ValueError(f"config has no field {path!r}.")
      node = node[p]
    if leaf not in node:
      raise ValueError(f"config has no field {path!r}.")
    node[leaf] = value
  return config
