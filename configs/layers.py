"""Layer configs: the keyword arguments of `KimiDeltaAttention`, locked.

`kda_config()` holds exactly the constructor's keywords (minus `name`), so a
model builds the layer as `KimiDeltaAttention(**config.model.kda)`, and a
misspelt override fails because the dict is locked. Values are checked where
the model is built (`experiments.training.model.validate_model_config` runs the
constructor's own checks, `validate_kda_layer_args`), before anything runs.

The default gate is the lower-bound ("safe") gate at -5, so every step
decays by at least exp(-5) (arXiv 2510.26692 gate; -5 is the recommended
bound); `lower_bound` may be overridden to None (the softplus gate) or to
another float in [-5, 0).

Example: `python -c "from configs import layers; print(layers.get_config())"`.
"""

import ml_collections
from ml_collections import config_dict


def kda_config() -> ml_collections.ConfigDict:
  """The default `KimiDeltaAttention` keywords, as a locked ConfigDict."""
  config = ml_collections.ConfigDict(dict(
      num_heads=2,
      head_dim=64,
      expand_v=1.0,
      conv_size=4,
      # A float, or None for the softplus gate (typed so None is allowed).
      lower_bound=config_dict.FieldReference(-5.0, field_type=float),
      backend="chunked",
      decay="channel",
      use_output_gate=True,
      # A mesh axis name when called inside shard_map with T split over it.
      context_axis=config_dict.placeholder(str),
      # Value heads (grouped value heads), a multiple of num_heads; None: H.
      num_v_heads=config_dict.placeholder(int),
      # beta = 2 sigmoid(.): transition eigenvalues in (-1, 1] (parity task).
      allow_neg_eigval=False,
      # Tokens per chunk of the chunked backend (16 or 64); None: platform's.
      chunk_size=config_dict.placeholder(int),
      # Matmul precision of the op and the layer's projections: "auto"
      # (float32-exact for float32 activations, fast for bfloat16),
      # "highest", "high" or "default" (jax.lax.Precision names). In a
      # model config, None follows model.precision.
      precision="auto",
  ))
  config.lock()
  return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`kda_config()`; `arg` is unused (the configs/ entry-point convention)."""
  del arg
  return kda_config()
