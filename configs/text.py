r"""Kimi Linear as a byte-level language model on the Python standard library.

The model has Kimi Linear's shape (arXiv 2510.26692, §4): three KDA layers
to one global softmax-attention layer without positional encoding
(`model.mixer="kda,kda,kda,attention"`, `model.attention.rope=False`), here
4 layers of width 128. The task reads the `.py` files of this interpreter's
standard library, one token a byte (experiments/tasks/text.py); held-out
bits per byte are measured at the training length and at 2x to 16x it
(`train.eval_lengths`: the same parameters on longer windows of held-out
files), every length scoring the same final 256 bytes of each window
(`train.eval_score_last`: the longer windows put more context in front).
Training: AdamW at a constant 1e-3 after 100 warm-up steps, 2000 steps of
16 x 256 bytes; the run's status reads its held-out bits per byte
(`train.status_rule="loss"`: converged once they fall by less than 0.005
over the last 10% of the steps), and a constant rate lets a sweep extend a
run still falling exactly as a longer run would (configs/sweeps/text.py).

  python run_experiment.py --config=configs/text.py --workdir=workdirs/text
  python -m experiments.generate --workdir=workdirs/text \
      --prompt="def main(" --max_new_tokens=200

Variants: `:smoke` (a tiny model and a few steps, for tests; set
`task.source_dir` to a small corpus), and the mixers of the sweep
(configs/sweeps/text.py): `--config.model.mixer=kda`, `=gdn`, `=attention`.
"""

import ml_collections

from configs import common as config_lib

SEQ_LEN = 256
EVAL_LENGTHS = (512, 1024, 2048, 4096)  # 2x .. 16x the training length
# The first pass; a sweep extends the runs whose held-out bits per byte are
# still falling (configs/sweeps/text.py).
NUM_STEPS = 2000
# Where the byte corpus is built once, outside every workdir ("~": home).
CORPUS_CACHE_DIR = "~/.cache/linear_attention/text_corpus"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The text config; `arg` is None / "" (default) or "smoke"."""
  arg = arg or ""
  if arg not in ("", "smoke"):
    raise ValueError(f"configs/text.py variant must be '' or 'smoke'; got"
                     f" {arg!r}.")
  config = ml_collections.ConfigDict()
  config.seed = 0
  # The corpus is built once into cache_dir and shared by every run (not
  # under a run's workdir); experiments.tasks.text.CACHE_DIR.
  config.task = dict(name="text", seq_len=SEQ_LEN, source_dir="",
                     cache_dir=CORPUS_CACHE_DIR, split="train")
  config.model = config_lib.model_config(
      mixer="kda,kda,kda,attention", num_layers=4, d_model=128,
      mlp_hidden=384, num_heads=2, head_dim=64, conv_size=4)
  config.model.attention.rope = False  # Kimi Linear's global layers: NoPE
  config.train = config_lib.train_config(
      num_steps=NUM_STEPS, batch_size=16, learning_rate=1e-3,
      warmup_steps=100, schedule="constant", eval_every=50, eval_batches=8,
      eval_batch_size=16, checkpoint_every=200, eval_lengths=EVAL_LENGTHS,
      eval_score_last=SEQ_LEN, status_rule="loss")
  config.mesh = config_lib.mesh_config()
  if arg == "smoke":
    config.task.seq_len = 32
    config.model = config_lib.model_config(
        mixer="kda,attention", num_layers=2, d_model=32, mlp_hidden=32,
        num_heads=2, head_dim=16)
    config.model.attention.rope = False
    config.train = config_lib.train_config(
        num_steps=4, batch_size=4, warmup_steps=1, log_every=1, eval_every=2,
        eval_batches=1, eval_batch_size=4, checkpoint_every=2,
        eval_lengths=(64,), eval_score_last=32, schedule="constant",
        status_rule="loss")
  config.lock()
  return config
