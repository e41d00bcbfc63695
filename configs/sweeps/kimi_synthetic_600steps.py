r"""The first protocol of the Kimi synthetic suite: 600 steps, cosine, 3e-3.

The grid of configs/sweeps/kimi_synthetic.py (tasks, lengths, batches,
model, seeds, `kda_zeroed`) under the schedule its 84 committed runs
(results/kimi_synthetic_600steps/) were trained with: one learning rate,
3e-3, for every mixer; a 20-step warm-up and cosine decay to 0.1x over 600
steps; Palindrome's length curriculum in equal shares of the 600 steps.
Most of its runs were still learning at the cap (docs/experiments.md),
which is why the suite moved to the extendable protocol.

  python -m experiments.sweep --config=configs/sweeps/kimi_synthetic_600steps.py \
      --workdir=workdirs/kimi_synthetic_600steps
"""

import ml_collections

from configs.sweeps import kimi_synthetic as suite

NUM_STEPS = 600


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The first protocol's sweep; no variants."""
  if arg:
    raise ValueError("configs/sweeps/kimi_synthetic_600steps.py takes no"
                     f" variant; got {arg!r}.")
  cells = []
  for cell in suite.cells(NUM_STEPS):
    stages = len(cell.get("length_curriculum", ()))
    if stages:  # equal shares of the 600 steps at each length
      cell["length_curriculum"] = suite.palindrome_curriculum(
          cell["task"]["seq_len"], NUM_STEPS // (stages + 1))
    cells.append(cell)
  return suite.sweep(
      name="kimi_synthetic_600steps", cell_list=tuple(cells),
      base_config=suite.base(num_steps=NUM_STEPS, learning_rate=3e-3,
                             schedule="cosine", warmup_steps=20),
      learning_rates=(3e-3,))
