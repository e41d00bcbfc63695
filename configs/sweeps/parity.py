r"""Parity with and without negative eigenvalues, seeds, longer lengths.

Does `allow_neg_eigval` (beta in [0, 2]: transition eigenvalues in [-1, 1])
let KDA track parity, and keep tracking it past its training length, where
beta in [0, 1] cannot (Grazzi et al., arXiv 2411.12537)? Same for Gated
DeltaNet (KDA with one decay per head); softmax attention (RoPE) as the
non-recurrent baseline.

  python -m experiments.sweep --config=configs/sweeps/parity.py \
      --workdir=workdirs/parity

Every run is configs/parity.py's: train at T=64 for 1500 steps (batch 32,
lr 3e-3; no early stop, so every run gets the same budget), then the final
parameters are evaluated at T = 64, 128, 256, 512, 1024
(`train.eval_lengths`). Grid: mixers {kda, kda_negeig, gdn, gdn_negeig,
attention} x seeds {0, 1, 2}: 15 runs, a few minutes each on one core.
Committed results: results/parity/ (results.md, length_generalisation.png).

Variant `:smoke` (for tests): T=16, a tiny model, a few steps, kda and
kda_negeig, one seed.
"""

import ml_collections

from configs import parity

VARIANTS = {  # name -> (dotted field, value) pairs
    "kda_negeig": (("model.mixer", "kda"),
                   ("model.kda.allow_neg_eigval", True)),
    "gdn_negeig": (("model.mixer", "gdn"),
                   ("model.kda.allow_neg_eigval", True)),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The sweep; `arg` is None / "" (the full grid) or "smoke"."""
  arg = arg or ""
  if arg not in ("", "smoke"):
    raise ValueError("configs/sweeps/parity.py variant must be '' or"
                     f" 'smoke'; got {arg!r}.")
  base = parity.get_config(arg)
  config = ml_collections.ConfigDict()
  config.name = "parity"
  config.base = base
  config.cells = (dict(task=base.task.to_dict(),
                       num_steps=base.train.num_steps),)
  config.mixers = ("kda", "kda_negeig", "gdn", "gdn_negeig", "attention")
  config.variants = VARIANTS
  config.seeds = (0, 1, 2)
  config.learning_rates = (base.train.learning_rate,)
  config.curve_seq_len = base.task.seq_len  # held-out accuracy vs step
  if arg == "smoke":
    config.mixers = ("kda", "kda_negeig")
    config.seeds = (0,)
  return config
