"""A small language model whose token mixer is chosen by name.

Glossary of shapes: B batch, T time, D model width, H heads, Dh head dim,
V vocabulary.

    tokens [B, T] -> embed [B, T, D]
      -> num_layers x ( x + mixer(RMSNorm(x)) ; x + MLP(RMSNorm(x)) )
      -> RMSNorm -> unembed [B, T, V]

`model.mixer` names one mixer for every layer, or a comma-separated
pattern repeated over the layers (`layer_mixers`): "kda,kda,kda,attention"
with `model.attention.rope=False` is Kimi Linear's hybrid (arXiv 2510.26692,
§4: three KDA layers to one global attention layer without positional
encoding). Packed documents (`segment_ids`) and decoding with a cache
(`init_cache`) work for every mixer and pattern.

Mixers (`MIXERS`):

* `kda`: `linear_attention.modules.KimiDeltaAttention` (Kimi Linear,
  arXiv 2510.26692), configured by `config.model.kda`;
* `kda_zeroed`: the same layer, same parameters and compute, output times 0:
  the model keeps everything but the memory, the ablation that shows the
  memory is what solves a task;
* `gdn`: the same layer with one decay per head shared across the key
  channels (decay="head"), i.e. Gated DeltaNet;
* `attention`: causal softmax attention with RoPE (or none) and the same
  causal depthwise short convolution (+ SiLU) on q, k and v as KDA
  (`experiments.attention`), the fair baseline;
* `none`: no mixer, the MLP blocks only.

Modules take plain arguments; `make_model` spreads the config once, inside
the function given to `hk.transform`.
"""

import contextlib
import dataclasses
from typing import Any, Callable

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from experiments import attention as attention_lib
from experiments import interpret
from linear_attention.modules import kda as kda_module
from linear_attention.ops.kda import api as kda_api

# The mixers built on the KDA layer, and every mixer: the one list of names.
KDA_MIXERS = ("kda", "kda_zeroed", "gdn")
MIXERS = KDA_MIXERS + ("attention", "none")
COMPUTE_DTYPES = ("float32", "bfloat16")  # config.model.compute_dtype


@dataclasses.dataclass
class MLP(hk.Module):
  """Linear(D -> hidden) -> GELU -> Linear(hidden -> D)."""

  hidden: int
  name: str | None = None

  def __call__(self, x: jax.Array) -> jax.Array:
    init = hk.initializers.TruncatedNormal(0.02)
    y = jax.nn.gelu(hk.Linear(self.hidden, w_init=init, name="up")(x))
    return hk.Linear(x.shape[-1], w_init=init, name="down")(y)


@dataclasses.dataclass
class LanguageModel(hk.Module):
  """Embedding, pre-norm (mixer + MLP) blocks with residuals, unembedding."""

  vocab_size: int  # V
  d_model: int  # D
  mixers: tuple[str, ...]  # one name of `MIXERS` per layer
  mlp_hidden: int  # MLP hidden width
  make_mixer: Callable[[str, str], Any]  # (mixer, module name) -> layer
  name: str | None = None

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               cache: tuple | None = None):
    """logits [B, T, V]; with `cache` (`init_cache`), (logits, new_cache).

    `segment_ids` [B, T]: packed documents (1, 2, ..; 0 = padding); no
    layer lets information cross a document boundary.
    """
    x = hk.Embed(self.vocab_size, self.d_model,
                 w_init=hk.initializers.TruncatedNormal(0.02),
                 name="embed")(tokens)
    new_cache = []
    for i, mixer in enumerate(self.mixers):
      layer_cache = None
      if mixer != "none":
        y = hk.RMSNorm(-1, name=f"mixer_norm_{i}")(x)
        layer = self.make_mixer(mixer, f"mixer_{i}")
        if cache is None:
          y = layer(y, segment_ids)
        else:
          y, layer_cache = layer(y, segment_ids, cache=cache[i])
        x = x + y
      new_cache.append(layer_cache)
      y = hk.RMSNorm(-1, name=f"mlp_norm_{i}")(x)
      x = x + MLP(self.mlp_hidden, name=f"mlp_{i}")(y)
    x = hk.RMSNorm(-1, name="final_norm")(x)
    logits = hk.Linear(self.vocab_size, with_bias=False,
                       w_init=hk.initializers.TruncatedNormal(0.02),
                       name="unembed")(x)
    return logits if cache is None else (logits, tuple(new_cache))


def mixer_factory(*, kda: dict[str, Any], attention: dict[str, Any]):
  """make_mixer(mixer, name) for `LanguageModel`.

  Args:
    kda: keyword arguments of `KimiDeltaAttention` (config.model.kda).
    attention: keyword arguments of `ShortConvSoftmaxAttention`.
  """

  def make_mixer(mixer: str, name: str):
    match mixer:
      case "kda":
        return kda_module.KimiDeltaAttention(**kda, name=name)
      case "kda_zeroed":
        layer = kda_module.KimiDeltaAttention(**kda, name=name)

        def zeroed(x, segment_ids=None, cache=None):
          if cache is None:
            return layer(x, segment_ids) * 0.0
          y, cache = layer(x, segment_ids, cache=cache)
          return y * 0.0, cache

        return zeroed
      case "gdn":
        return kda_module.KimiDeltaAttention(**{**kda, "decay": "head"},
                                             name=name)
      case "attention":
        return attention_lib.ShortConvSoftmaxAttention(**attention, name=name)
    raise ValueError(f"model.mixer must name mixers of {list(MIXERS)}; got"
                     f" {mixer!r}.")

  return make_mixer


def layer_mixers(model) -> tuple[str, ...]:
  """The mixer of each layer: `model.mixer` is one name of `MIXERS`, or a
  comma-separated pattern of them repeated over `model.num_layers` (e.g.
  "kda,kda,kda,attention": Kimi Linear's 3:1 hybrid)."""
  pattern = tuple(m.strip() for m in str(model.mixer).split(","))
  bad = [m for m in pattern if m not in MIXERS]
  if bad:
    raise ValueError(f"model.mixer must be one of {list(MIXERS)} or a"
                     f" comma-separated pattern of them; got"
                     f" {model.mixer!r}.")
  if model.num_layers % len(pattern):
    raise ValueError(
        f"model.num_layers ({model.num_layers}) must be a multiple of the"
        f" length of the mixer pattern {model.mixer!r} ({len(pattern)}).")
  return pattern * (model.num_layers // len(pattern))


def init_cache(model, batch_size: int, max_len: int) -> tuple:
  """The all-zero decode cache of a model of `config.model`: per layer a
  `KDACache` (KDA, GDN), an `AttentionCache` of `max_len` positions, or
  None (no mixer). Usable outside `hk.transform`."""
  kda = {k: model.kda[k] for k in ("num_heads", "head_dim", "expand_v",
                                    "conv_size", "num_v_heads")}
  att = model.attention
  out = []
  for mixer in layer_mixers(model):
    if mixer in KDA_MIXERS:
      out.append(kda_module.init_kda_cache(batch_size, **kda))
    elif mixer == "attention":
      out.append(attention_lib.init_attention_cache(
          batch_size, num_heads=att.num_heads, head_dim=att.head_dim,
          conv_size=att.conv_size, max_len=max_len))
    else:
      out.append(None)
  return tuple(out)


def cache_positions(cache) -> int | None:
  """How many positions `cache` (`init_cache`'s) holds: its attention
  layers' key/value buffer length, or None when no layer has a bound (KDA
  and GDN keep a state of one size at any length)."""
  lengths = [layer.k.shape[1] for layer in cache
             if isinstance(layer, attention_lib.AttentionCache)]
  return min(lengths) if lengths else None


def validate_model_config(model, vocab_size: int) -> None:
  """Raises ValueError naming the field for a bad `config.model`."""
  for field in ("num_layers", "d_model", "mlp_hidden"):
    value = model[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"model.{field} must be an int >= 1; got {value!r}.")
  mixers = layer_mixers(model)
  dtype = model.get("compute_dtype", "float32")
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(f"model.compute_dtype must be one of {COMPUTE_DTYPES};"
                     f" got {dtype!r}.")
  att = model.attention
  for field, low in (("num_heads", 1), ("head_dim", 2), ("conv_size", 0)):
    value = att[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"model.attention.{field} must be an int >= {low};"
                       f" got {value!r}.")
  if att.head_dim % 2:
    raise ValueError(f"model.attention.head_dim must be even (RoPE); got"
                     f" {att.head_dim}.")
  if not isinstance(att.get("rope", True), bool):
    raise ValueError(f"model.attention.rope must be a bool; got"
                     f" {att.rope!r}.")
  if not isinstance(att.rope_base, (int, float)) or not (
      1 < att.rope_base < float("inf")):
    raise ValueError(f"model.attention.rope_base must be a finite number > 1;"
                     f" got {att.rope_base!r}.")
  if any(m in KDA_MIXERS for m in mixers):
    try:
      kda_module.validate_kda_layer_args(**model.kda)
    except ValueError as e:  # the layer names its argument; say where it is
      raise ValueError(f"model.kda: {e}") from None
  del vocab_size


def make_model(model, vocab_size: int) -> hk.Transformed:
  """hk.transform of the LM; `model` is `config.model` (read once, here).

  `apply(params, tokens, segment_ids=None, cache=None)` gives the logits
  (`LanguageModel`), with a cache (`init_cache`) also the new cache.

  `model.compute_dtype="bfloat16"` is mixed precision: parameters (and so
  the optimizer state) stay float32; `apply` computes with a bfloat16 copy
  of them, so activations and matmuls are bfloat16, the KDA op still
  accumulates its state in float32, and the logits come back float32 for the
  loss. Gradients flow through the cast into the float32 parameters.
  """
  validate_model_config(model, vocab_size)
  compute_dtype = jnp.dtype(model.get("compute_dtype", "float32"))
  kda = model.kda.to_dict()
  attention = model.attention.to_dict()
  kwargs = dict(vocab_size=vocab_size, d_model=model.d_model,
                mixers=layer_mixers(model), mlp_hidden=model.mlp_hidden)

  def forward(tokens, segment_ids=None, cache=None):
    make_mixer = mixer_factory(kda=kda, attention=attention)
    return LanguageModel(make_mixer=make_mixer, name="lm", **kwargs)(
        tokens, segment_ids, cache)

  transformed = hk.without_apply_rng(hk.transform(forward))
  if compute_dtype == jnp.float32:
    return transformed

  def apply(params, tokens, segment_ids=None, cache=None):
    low = jax.tree.map(
        lambda p: p.astype(compute_dtype)
        if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    out = transformed.apply(low, tokens, segment_ids, cache)
    if cache is None:
      return out.astype(jnp.float32)
    return out[0].astype(jnp.float32), out[1]

  return hk.Transformed(init=transformed.init, apply=apply)


def uses_kda(model) -> bool:
  """Whether a model of this config (`config.model`) has a KDA layer."""
  return any(m in KDA_MIXERS for m in layer_mixers(model))


def kda_backend(model) -> str | None:
  """The KDA backend the model runs, as the op resolves it; None if no KDA."""
  return kda_api.resolved_backend(model.kda.backend) if uses_kda(model) else None


def host_context(model):
  """What running the model on this host needs, as a context manager.

  Pallas interpret mode (`experiments.interpret`: seconds per call, tiny
  shapes only) when the op says its backend runs interpreted here (`mosaic`
  off TPU); nothing otherwise.
  """
  if not (uses_kda(model) and kda_api.runs_interpreted(model.kda.backend)):
    return contextlib.nullcontext()
  logging.info(
      "KDA backend is mosaic and the default device is %s, not a TPU:"
      " running inside experiments.interpret.interpret_mode() (Pallas"
      " interpret mode, slow).", jax.default_backend())
  return interpret.interpret_mode()


def count_params(params) -> int:
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))
