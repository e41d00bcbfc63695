r"""Kimi Linear's hybrid against its parts as byte-level language models.

Mixers at matched parameter counts (within 0.3% of 863K; each MLP's width
absorbs its mixer's parameters): `kda` (MLP 384), `gdn` (448), `attention`
with RoPE (512), `attention_nope` (512, no positional encoding) and
`hybrid`, Kimi Linear's 3:1 "kda,kda,kda,attention" with NoPE attention
(416). Every run is configs/text.py's (4 layers of width 128, T = 256, batch
16, AdamW at a constant 1e-3 after 100 warm-up steps), 3 seeds; held-out
bits per byte at T = 256 and at 2x..16x it, every length scoring the same
final 256 bytes of each held-out window (`train.eval_score_last`).

The protocol: a first pass of NUM_STEPS (2000) steps a run, then every run
whose held-out bits per byte still fall (`metrics.loss_status`: by 0.005 or
more over the last 10% of its steps, by the least-squares line or by the
lowest evaluation) continues EXTEND_STEP (1000) steps at a time, exactly as
a longer run would (a constant rate), until it converges or reaches
MAX_STEPS (6000), the cap the compute allows (two workers, one per core of
a 2-core machine, at about 1.5 steps a second each: the first pass is
about 6 CPU-hours, 15 runs at the cap about 17), each worker taking one
run at a time to its end:

  taskset -c 0 python -m experiments.sweep --config=configs/sweeps/text.py \
      --workdir=workdirs/text --extend_to=6000 --extend_step=1000 \
      --depth_first &
  taskset -c 1 python -m experiments.sweep ...  # the same flags

The learning rate (1e-3) was not tuned for this task: it is the one the
synthetic calibration found good for KDA and GDN at this width.

Results: results/text/ (README, and docs/experiments.md, Text; the previous
protocol's 800-step runs are in the history, results/text/ at 013e41d).
Variant
`:smoke` (tests): the smoke model (2 layers), kda and a 1:1 hybrid, one
seed.
"""

import ml_collections

from configs import text

NUM_STEPS = text.NUM_STEPS  # the first pass (and the fewest steps a run has)
MAX_STEPS = 6000  # --extend_to: the most steps a run is extended to
EXTEND_STEP = 1000  # --extend_step
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
  config.seeds = (0, 1, 2)
  config.learning_rates = (base.train.learning_rate,)
  config.curve_seq_len = base.task.seq_len
  if arg == "smoke":
    config.variants = {"kda": VARIANTS["kda"][:1],  # 2 layers: hybrid 1:1
                       "hybrid": (("model.mixer", "kda,attention"),)}
    config.mixers = ("kda", "hybrid")
    config.seeds = (0,)
  return config
