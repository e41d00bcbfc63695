r"""Kimi Linear's hybrid against its parts as byte-level language models.

Mixers at matched parameter counts (within 0.3% of 863K; each MLP's width
absorbs its mixer's parameters): `kda` (MLP 384), `gdn` (448), `attention`
with RoPE (512), `attention_nope` (512, no positional encoding) and
`hybrid`, Kimi Linear's 3:1 "kda,kda,kda,attention" with NoPE attention
(416). Every run is configs/text.py's (4 layers of width 128, T = 256, batch
16, 800 steps: one token budget of 3.3M bytes for all), 2 seeds; held-out
bits per byte at T = 256 and at 2x..16x it. The budget is what ten runs
cost in about two hours on a 2-core machine (a run takes about 22 minutes
of one core: 0.7 steps a second, plus 2-3 minutes of evaluation at up to
4096 bytes); the learning rate (1e-3, cosine to 0.1x after 100 warm-up
steps) is the one the synthetic calibration found good for KDA and GDN.

  python -m experiments.sweep --config=configs/sweeps/text.py \
      --workdir=workdirs/text

Results: results/text/ (trained at commit c7fe319; README, and
docs/experiments.md, Text). Variant `:smoke` (tests): the
smoke model (2 layers), kda and a 1:1 hybrid, one seed.
"""

import ml_collections

from configs import text

MLP_HIDDEN = {"kda": 384, "gdn": 448, "attention": 512,
              "attention_nope": 512, "hybrid": 416}
VARIANTS = {
    "kda": (("model.mixer", "kda"),
            ("model.mlp_hidden", MLP_HIDDEN["kda"])),
    "gdn": (("model.mixer", "gdn"),
            ("model.mlp_hidden", MLP_HIDDEN["gdn"])),
    "attention": (("model.mixer", "attention"),
                  ("model.mlp_hidden", MLP_HIDDEN["attention"]),
                  ("model.attention.rope", True)),
    "attention_nope": (("model.mixer", "attention"),
                       ("model.mlp_hidden", MLP_HIDDEN["attention_nope"]),
                       ("model.attention.rope", False)),
    "hybrid": (("model.mixer", "kda,kda,kda,attention"),
               ("model.mlp_hidden", MLP_HIDDEN["hybrid"]),
               ("model.attention.rope", False)),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The sweep; `arg` is None / "" (the grid) or "smoke"."""
  arg = arg or ""
  if arg not in ("", "smoke"):
    raise ValueError("configs/sweeps/text.py variant must be '' or 'smoke';"
                     f" got {arg!r}.")
  base = text.get_config(arg)
  config = ml_collections.ConfigDict()
  config.name = "text"
  config.base = base
  config.cells = (dict(task=base.task.to_dict(),
                       num_steps=base.train.num_steps),)
  config.mixers = tuple(MLP_HIDDEN)
  config.variants = VARIANTS
  config.seeds = (0, 1)
  config.learning_rates = (base.train.learning_rate,)
  config.curve_seq_len = base.task.seq_len
  if arg == "smoke":
    config.variants = {"kda": VARIANTS["kda"][:1],  # 2 layers: hybrid 1:1
                       "hybrid": (("model.mixer", "kda,attention"),)}
    config.mixers = ("kda", "hybrid")
    config.seeds = (0,)
  return config
