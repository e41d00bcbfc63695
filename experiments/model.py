"""A small language model whose token mixer is chosen by name.

Glossary of shapes: B batch, T time, D model width, H heads, Dh head dim,
V vocabulary.

    tokens [B, T] -> embed [B, T, D]
      -> num_layers x ( x + mixer(RMSNorm(x)) ; x + MLP(RMSNorm(x)) )
      -> RMSNorm -> unembed [B, T, V]

Mixers (`MIXERS`):

* `kda`: `linear_attention.modules.KimiDeltaAttention` (Kimi Linear,
  arXiv 2510.26692), configured by `config.model.kda`;
* `kda_zeroed`: the same layer, same parameters and compute, output times 0:
  the model keeps everything but the memory, the ablation that shows the
  memory is what solves a task;
* `gdn`: the same layer with one decay per head shared across the key
  channels (decay="head"), i.e. Gated DeltaNet;
* `attention`: causal softmax attention with RoPE and the same causal
  depthwise short convolution (+ SiLU) on q, k and v as KDA, the fair
  baseline (without the conv it sat at the 1/N plateau on MQAR);
* `none`: no mixer, the MLP blocks only.

Modules take plain arguments; `make_model` spreads the config once, inside
the function given to `hk.transform`.
"""

import dataclasses
from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.modules import kda as kda_module
from linear_attention.modules import short_conv

# The mixers built on the KDA layer, and every mixer: the one list of names.
KDA_MIXERS = ("kda", "kda_zeroed", "gdn")
MIXERS = KDA_MIXERS + ("attention", "none")
COMPUTE_DTYPES = ("float32", "bfloat16")  # config.model.compute_dtype


def rope(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding on [B, T, H, Dh] (halves rotated, Dh even)."""
  _, t, _, dh = x.shape
  half = dh // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


@dataclasses.dataclass
class ShortConvSoftmaxAttention(hk.Module):
  """Causal softmax attention with RoPE and a short conv on q, k, v.

  q, k, v = SiLU(ShortConvolution(Linear(x))), the same causal depthwise
  conv module (`linear_attention.modules.ShortConvolution`, W taps) and
  activation as the KDA layer; RoPE on q and k, softmax(q k^T / sqrt(Dh)) with a
  causal mask, then an output projection back to D.
  """

  num_heads: int  # H
  head_dim: int  # Dh (even, for RoPE)
  conv_size: int = 4  # W taps of the short conv; 0 = no conv, SiLU only
  rope_base: float = 10_000.0  # RoPE wavelength base
  name: str | None = None

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h, dh = self.num_heads, self.head_dim
    init = hk.initializers.RandomNormal(0.02)  # as the KDA layer
    qkv = []
    for name in "qkv":
      y = hk.Linear(h * dh, with_bias=False, w_init=init,
                    name=f"{name}_proj")(x)
      if self.conv_size > 0:
        y = short_conv.ShortConvolution(self.conv_size, activation="silu",
                                        name=f"{name}_conv1d")(y)
      else:
        y = jax.nn.silu(y)
      qkv.append(y.reshape(b, t, h, dh))
    q, k, v = qkv
    q, k = rope(q, self.rope_base), rope(k, self.rope_base)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) * dh ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v)
    return hk.Linear(d, with_bias=False, w_init=init, name="out")(
        o.reshape(b, t, h * dh))


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
  num_layers: int  # number of (mixer, MLP) blocks
  mlp_hidden: int  # MLP hidden width
  make_mixer: Callable[[str], Callable[[jax.Array], jax.Array]] | None
  # make_mixer(name) -> a callable [B, T, D] -> [B, T, D]; None = no mixer.
  name: str | None = None

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = hk.Embed(self.vocab_size, self.d_model,
                 w_init=hk.initializers.TruncatedNormal(0.02),
                 name="embed")(tokens)
    for i in range(self.num_layers):
      if self.make_mixer is not None:
        y = hk.RMSNorm(-1, name=f"mixer_norm_{i}")(x)
        x = x + self.make_mixer(f"mixer_{i}")(y)
      y = hk.RMSNorm(-1, name=f"mlp_norm_{i}")(x)
      x = x + MLP(self.mlp_hidden, name=f"mlp_{i}")(y)
    x = hk.RMSNorm(-1, name="final_norm")(x)
    return hk.Linear(self.vocab_size, with_bias=False,
                     w_init=hk.initializers.TruncatedNormal(0.02),
                     name="unembed")(x)


def mixer_factory(mixer: str, *, kda: dict[str, Any],
                  attention: dict[str, Any]):
  """make_mixer(name) for `LanguageModel`, or None for mixer="none".

  Args:
    mixer: one of `MIXERS`.
    kda: keyword arguments of `KimiDeltaAttention` (config.model.kda).
    attention: keyword arguments of `ShortConvSoftmaxAttention`.
  """
  match mixer:
    case "kda":
      return lambda name: kda_module.KimiDeltaAttention(**kda, name=name)
    case "kda_zeroed":
      def zeroed(name):
        layer = kda_module.KimiDeltaAttention(**kda, name=name)
        return lambda x: layer(x) * 0.0
      return zeroed
    case "gdn":
      return lambda name: kda_module.KimiDeltaAttention(**{**kda, "decay": "head"}, name=name)
    case "attention":
      return lambda name: ShortConvSoftmaxAttention(**attention, name=name)
    case "none":
      return None
    case _:
      raise ValueError(f"model.mixer must be one of {list(MIXERS)}; got"
                       f" {mixer!r}.")


def validate_model_config(model, vocab_size: int) -> None:
  """Raises ValueError naming the field for a bad `config.model`."""
  if model.mixer not in MIXERS:
    raise ValueError(f"model.mixer must be one of {list(MIXERS)}; got"
                     f" {model.mixer!r}.")
  for field in ("num_layers", "d_model", "mlp_hidden"):
    value = model[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"model.{field} must be an int >= 1; got {value!r}.")
  dtype = model.get("compute_dtype", "float32")
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(f"model.compute_dtype must be one of {COMPUTE_DTYPES};"
                     f" got {dtype!r}.")
  att = model.attention
  if att.head_dim % 2:
    raise ValueError(f"model.attention.head_dim must be even (RoPE); got"
                     f" {att.head_dim}.")
  if model.mixer in KDA_MIXERS:
    kda_module.validate_kda_layer_args(**model.kda)
  del vocab_size


def make_model(model, vocab_size: int) -> hk.Transformed:
  """hk.transform of the LM; `model` is `config.model` (read once, here).

  `model.compute_dtype="bfloat16"` is mixed precision: parameters (and so
  the optimizer state) stay float32; `apply` computes with a bfloat16 copy
  of them, so activations and matmuls are bfloat16, the KDA op still
  accumulates its state in float32, and the logits come back float32 for the
  loss. Gradients flow through the cast into the float32 parameters.
  """
  validate_model_config(model, vocab_size)
  compute_dtype = jnp.dtype(model.get("compute_dtype", "float32"))
  mixer = model.mixer
  kda = model.kda.to_dict()
  attention = model.attention.to_dict()
  kwargs = dict(vocab_size=vocab_size, d_model=model.d_model,
                num_layers=model.num_layers, mlp_hidden=model.mlp_hidden)

  def forward(tokens: jax.Array) -> jax.Array:
    make_mixer = mixer_factory(mixer, kda=kda, attention=attention)
    return LanguageModel(make_mixer=make_mixer, name="lm", **kwargs)(tokens)

  transformed = hk.without_apply_rng(hk.transform(forward))
  if compute_dtype == jnp.float32:
    return transformed

  def apply(params, tokens):
    low = jax.tree.map(
        lambda p: p.astype(compute_dtype)
        if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    return transformed.apply(low, tokens).astype(jnp.float32)

  return hk.Transformed(init=transformed.init, apply=apply)


def count_params(params) -> int:
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))
