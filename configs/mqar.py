r"""MQAR (Zoology multi-query associative recall): T=256, 16 key-value pairs.

A 2-layer, width-128 model; the mixer is the ablation axis.

Single run (2-core CPU, chunked KDA backend):

  python run_experiment.py --config=configs/mqar.py --workdir=workdirs/mqar_kda

targets >= 99% held-out query accuracy (chance 1/32 = 3.1%) and stops there
(`train.stop_at_accuracy`). NOT yet reached: on a 2-core CPU shared with
other jobs (0.15 steps/s) the measured run had 6.3% at step 150 of 300,
rising slowly from the chance plateau after step ~110 (results/mqar/); the
learning rate / batch / head_dim need tuning on a quieter machine.
`--config.model.mixer=kda_zeroed` and `=none` stay at chance.
Ablation (kda vs kda_zeroed, prints the table):

  python -m experiments.ablate --config=configs/mqar.py \
      --mixers=kda,kda_zeroed --workdir=workdirs/mqar_ablation

Variants: `configs/mqar.py:smoke` (T=64, 4 pairs, tiny model, a few steps:
runs in seconds, for tests).
"""

import ml_collections

from experiments import config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The MQAR config; `arg` is None / "" (default) or "smoke"."""
  arg = arg or ""
  if arg not in ("", "smoke"):
    raise ValueError(f"configs/mqar.py variant must be '' or 'smoke'; got"
                     f" {arg!r}.")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.task = dict(
      name="mqar",
      seq_len=256,
      num_pairs=16,
      vocab_size=64,  # keys 1..31, values 32..63: chance 1/32
      power_a=0.01,
      random_filler=False,
  )
  config.model = config_lib.model_config(mixer="kda", num_layers=2,
                                         d_model=128, mlp_hidden=256,
                                         num_heads=2, head_dim=32)
  config.train = config_lib.train_config(
      num_steps=300, batch_size=64, learning_rate=3e-3, warmup_steps=20,
      eval_every=10, eval_batches=2, checkpoint_every=50,
      stop_at_accuracy=0.99)
  if arg == "smoke":
    config.task.seq_len = 64
    config.task.num_pairs = 4
    config.task.vocab_size = 32
    config.model = config_lib.model_config(mixer="kda", num_layers=1,
                                           d_model=32, mlp_hidden=32,
                                           num_heads=2, head_dim=16)
    config.train = config_lib.train_config(
        num_steps=6, batch_size=4, warmup_steps=1, log_every=1, eval_every=2,
        eval_batches=1, eval_batch_size=4, checkpoint_every=2)
  config.mesh = config_lib.mesh_config()
  config.lock()
  return config
