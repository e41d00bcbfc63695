r"""Parity (state tracking): the running parity of 64 bits, then longer.

Grazzi et al. (arXiv 2411.12537): a linear recurrence needs transition
eigenvalues below 0 to track parity; KDA's `allow_neg_eigval` (beta in
[0, 2]) gives them. Train at T=64, then evaluate the final parameters at
T = 64 .. 1024 (`train.eval_lengths`, summary.json `length_accuracy`):

  python run_experiment.py --config=configs/parity.py \
      --config.model.kda.allow_neg_eigval=True --workdir=workdirs/parity_neg

and without the flag for the [0, 1] baseline. Seeds and both variants:
configs/sweeps/parity.py (results/parity/).

Model: 2 layers of width 64, 2 heads of dim 32, short conv of 2 taps, safe
gate bound -1 (a decay can approach 1, which a parity counter needs), the
same for both variants; 1500 steps of batch 32 at lr 3e-3 (chance 50%).

Variant `configs/parity.py:smoke` (T=16, a tiny model, a few steps, two
evaluation lengths) is for tests.
"""

import ml_collections

from configs import common as config_lib

EVAL_LENGTHS = (64, 128, 256, 512, 1024)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The parity config; `arg` is None / "" (default) or "smoke"."""
  arg = arg or ""
  if arg not in ("", "smoke"):
    raise ValueError("configs/parity.py variant must be '' or 'smoke'; got"
                     f" {arg!r}.")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.task = dict(name="parity", seq_len=64)
  config.model = config_lib.model_config(mixer="kda", num_layers=2,
                                         d_model=64, mlp_hidden=128,
                                         num_heads=2, head_dim=32,
                                         conv_size=2)
  config.model.kda.lower_bound = -1.0
  config.train = config_lib.train_config(
      num_steps=1500, batch_size=32, learning_rate=3e-3, warmup_steps=50,
      eval_every=50, eval_batches=4, eval_batch_size=32,
      checkpoint_every=250, eval_lengths=EVAL_LENGTHS)
  if arg == "smoke":
    config.task.seq_len = 16
    config.model = config_lib.model_config(mixer="kda", num_layers=1,
                                           d_model=32, mlp_hidden=32,
                                           num_heads=2, head_dim=16)
    config.train = config_lib.train_config(
        num_steps=4, batch_size=4, warmup_steps=1, log_every=1, eval_every=2,
        eval_batches=1, eval_batch_size=4, checkpoint_every=2,
        eval_lengths=(16, 40))
  config.mesh = config_lib.mesh_config()
  config.lock()
  return config
