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

Mixers: the names of `linear_attention.modules.registry` (the built-in
ones in `MIXERS`); each layer's mixer is built from its config section
(`config.model.kda`, `config.model.attention`, ...) by its registry entry,
and called through the one mixer contract (`linear_attention.modules.
mixer`). Code here asks a mixer's capabilities, never which mixer it is.

* `kda`: `linear_attention.modules.KimiDeltaAttention` (Kimi Linear,
  arXiv 2510.26692), configured by `config.model.kda`;
* `kda_zeroed`: the same layer, same parameters and compute, output times 0:
  the model keeps everything but the memory, the ablation that shows the
  memory is what solves a task;
* `gdn`: the same layer with one decay per head shared across the key
  channels (decay="head"), i.e. Gated DeltaNet;
* `attention`: causal softmax attention with RoPE (or none) and the same
  causal depthwise short convolution (+ SiLU) on q, k and v as KDA
  (`linear_attention.modules.attention`), the fair baseline;
* `none`: no mixer, the MLP blocks only.

Precision: `model.precision` ("auto": float32-exact matmuls for float32
compute, one bfloat16 pass for bfloat16; `linear_attention.ops.precision`)
is pinned on the model's own matmuls (the MLPs and the unembedding; the
embedding is a lookup) and is the `precision` of every mixer section that
leaves its own as None (`model.attention.precision` by default);
`model.kda.precision` is the KDA layer's own ("auto" by default, None to
follow the model's).

Modules take plain arguments; `make_model` spreads the config once, inside
the function given to `hk.transform`.
"""

import contextlib
import dataclasses
from typing import Any, Mapping

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from configs import validation as config_checks
from experiments.training import interpret
from linear_attention.modules import pinned
from linear_attention.modules import registry
from linear_attention.ops.kda import api as kda_api

# The built-in mixer names (`registry.names()` also lists registered ones).
MIXERS = registry.names()


@dataclasses.dataclass
class MLP(hk.Module):
  """Linear(D -> hidden) -> GELU -> Linear(hidden -> D)."""

  hidden: int
  precision: str = "auto"  # of both matmuls (linear_attention/ops/precision.py)
  name: str | None = None

  def __call__(self, x: jax.Array) -> jax.Array:
    init = hk.initializers.TruncatedNormal(0.02)
    up = pinned.linear(x, self.hidden, precision=self.precision, w_init=init,
                       with_bias=True, name="up")
    return pinned.linear(jax.nn.gelu(up), x.shape[-1],
                         precision=self.precision, w_init=init,
                         with_bias=True, name="down")


@dataclasses.dataclass
class LanguageModel(hk.Module):
  """Embedding, pre-norm (mixer + MLP) blocks with residuals, unembedding."""

  vocab_size: int  # V
  d_model: int  # D
  mixers: tuple[str, ...]  # one registry name per layer
  mlp_hidden: int  # MLP hidden width
  # {section: keyword arguments}: the config sections the mixers read.
  sections: Mapping[str, Mapping[str, Any]]
  # Of the MLPs' and the unembedding's matmuls (the mixers take theirs from
  # `sections`): linear_attention/ops/precision.py.
  precision: str = "auto"
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
    for i, name in enumerate(self.mixers):
      entry = registry.get(name)
      layer_cache = None
      if entry is not None:
        y = hk.RMSNorm(-1, name=f"mixer_norm_{i}")(x)
        layer = entry.build(entry.keywords(self.sections), f"mixer_{i}")
        y, layer_cache = layer(y, segment_ids=segment_ids,
                               cache=None if cache is None else cache[i])
        x = x + y
      new_cache.append(layer_cache)
      y = hk.RMSNorm(-1, name=f"mlp_norm_{i}")(x)
      x = x + MLP(self.mlp_hidden, self.precision, name=f"mlp_{i}")(y)
    x = hk.RMSNorm(-1, name="final_norm")(x)
    logits = pinned.linear(x, self.vocab_size, precision=self.precision,
                           w_init=hk.initializers.TruncatedNormal(0.02),
                           name="unembed")
    return logits if cache is None else (logits, tuple(new_cache))


def layer_mixers(model) -> tuple[str, ...]:
  """The mixer of each layer: `model.mixer` is one registered name, or a
  comma-separated pattern of them repeated over `model.num_layers` (e.g.
  "kda,kda,kda,attention": Kimi Linear's 3:1 hybrid)."""
  return config_checks.mixer_pattern(model, registry.names())


def layer_entries(model) -> tuple:
  """The registry entry of each layer's mixer (None: no mixer)."""
  return tuple(registry.get(m) for m in layer_mixers(model))


def _model_precision(model) -> str:
  """`model.precision`; "auto" for a config saved before it existed."""
  return model.get("precision", "auto")


def _sections(model) -> dict[str, dict[str, Any]]:
  """{section: keyword arguments} of the sections the layers' mixers read;
  a section's `precision` of None is the model's (`_model_precision`)."""
  sections = {e.section: model[e.section].to_dict()
              for e in layer_entries(model)
              if e is not None and e.section is not None}
  for keywords in sections.values():
    if "precision" in keywords and keywords["precision"] is None:
      keywords["precision"] = _model_precision(model)
  return sections


def mixers_with(model, capability: str) -> tuple:
  """The distinct registry entries of the layers whose mixer has
  `capability` (a field of `mixer.Capabilities`), in layer order."""
  found = {}
  for e in layer_entries(model):
    if e is not None and getattr(e.capabilities, capability):
      found.setdefault(e.name, e)
  return tuple(found.values())


def sections_with(model, capability: str) -> tuple[str, ...]:
  """The config sections (`model.<section>`) read by mixers with
  `capability`, e.g. "op_backend" -> ("kda",) for a KDA or GDN model."""
  return tuple(dict.fromkeys(e.section for e in mixers_with(model, capability)
                             if e.section is not None))


def count_layers_with(model, capability: str) -> int:
  """How many layers run a mixer with `capability`."""
  return sum(1 for e in layer_entries(model)
             if e is not None and getattr(e.capabilities, capability))


def init_cache(model, batch_size: int, max_len: int) -> tuple:
  """The all-zero decode cache of a model of `config.model`: per layer its
  mixer's (`Mixer.init_cache`: a KDA state, attention's buffer of `max_len`
  positions, ...), or None (no mixer). Usable outside `hk.transform`."""
  sections = _sections(model)
  return tuple(None if e is None else
               e.init_cache(batch_size, max_len, e.keywords(sections))
               for e in layer_entries(model))


def cache_positions(cache) -> int | None:
  """How many positions `cache` (`init_cache`'s) holds: the least of its
  layers' `max_positions` (attention's key/value buffers), or None when no
  layer has a bound (a recurrent state has one size at any length)."""
  lengths = [layer.max_positions for layer in cache
             if hasattr(layer, "max_positions")]
  return min(lengths) if lengths else None


def validate_model_config(model, vocab_size: int) -> None:
  """Raises ValueError naming the field for a bad `config.model`: its
  fields (`configs.validation`), then each layer's mixer's section."""
  config_checks.validate_model(model, registry.names())
  validate_mixer_sections(model)
  del vocab_size


def validate_mixer_sections(model) -> None:
  """Each layer's mixer checks its own keyword arguments (ValueError
  "model.<section>: <the mixer's message>")."""
  sections = _sections(model)
  for entry in {e.name: e for e in layer_entries(model) if e}.values():
    try:
      entry.validate(entry.keywords(sections))
    except (TypeError, ValueError) as e:  # TypeError: an unknown keyword
      raise ValueError(f"model.{entry.section}: {e}") from None


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
  kwargs = dict(vocab_size=vocab_size, d_model=model.d_model,
                mixers=layer_mixers(model), mlp_hidden=model.mlp_hidden,
                sections=_sections(model), precision=_model_precision(model))

  def forward(tokens, segment_ids=None, cache=None):
    return LanguageModel(name="lm", **kwargs)(tokens, segment_ids, cache)

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


def op_backends(model) -> tuple[str, ...]:
  """The KDA op backends the model's layers ask for (`backend` of each
  section read by a mixer with the "op_backend" capability); () if none."""
  return tuple(model[s].backend for s in sections_with(model, "op_backend"))


def kda_backend(model) -> str | None:
  """The KDA backend the model runs, as the op resolves it (its canonical
  name); None if no layer takes one."""
  names = {kda_api.resolved_backend(b) for b in op_backends(model)}
  return ",".join(sorted(names)) if names else None


def traces_under_check_vma(model) -> bool:
  """Whether every layer's op backend traces under shard_map's check_vma
  (tokamax's Pallas kernels do not)."""
  return all(kda_api.traces_under_check_vma(b) for b in op_backends(model))


def host_context(model):
  """What running the model on this host needs, as a context manager.

  Pallas interpret mode (`experiments.training.interpret`: seconds per call,
  tiny shapes only) when the op says a layer's backend runs interpreted here
  (`tokamax` off TPU); nothing otherwise.
  """
  if not any(kda_api.runs_interpreted(b) for b in op_backends(model)):
    return contextlib.nullcontext()
  logging.info(
      "KDA backend %s needs a TPU and the default device is %s:"
      " running inside experiments.training.interpret.interpret_mode() (Pallas"
      " interpret mode, slow).", kda_backend(model), jax.default_backend())
  return interpret.interpret_mode()


def count_params(params) -> int:
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))
