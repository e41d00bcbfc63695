"""Adding a mixer: one module and one registry entry, nothing else.

A toy mixer (a causal running mean over each document) is written here as a
new mixer would be (its module, its cache, its `Mixer` entry), registered,
and trained through the experiment path every mixer takes: a config file's
`get_config`, `model.mixer` naming it (alone and in a hybrid pattern), and
`experiments.training.train.train_and_evaluate`. Its cache obeys the contract (a
prefill plus decode steps give the full forward's logits), and the code
above the mixers asks its capabilities: it has no context parallelism, so a
context mesh is refused naming it.
"""

import json
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import common as config_lib
from configs import mqar
from experiments.training import model as model_lib
from experiments.training import program as program_lib
from experiments.training import train
from linear_attention import testing
from linear_attention.modules import mixer
from linear_attention.modules import pinned
from linear_attention.modules import registry
from linear_attention.ops import checks
from linear_attention.ops import precision
from tests import lowered


# --- the new mixer: what its own file would hold ----------------------------


class MeanCache(NamedTuple):
  total: jax.Array  # [B, W] sum of the projected inputs so far
  count: jax.Array  # [B] tokens so far


class CumulativeMean(hk.Module):
  """y_t = W_out (mean of W_in x_s over s <= t in t's document)."""

  def __init__(self, width: int, name: str | None = None):
    super().__init__(name=name)
    self.width = width

  def __call__(self, x, *, segment_ids=None, cache=None):
    # Every matmul pins its precision, as the library's modules do
    # (linear_attention/modules/pinned.py): at the process default a TPU
    # multiplies float32 in one bfloat16 pass, and the full forward's sum
    # (a product of bfloat16-rounded operands) would then miss the cache's
    # float32 cumsum by far more than the 1e-5 the cache test allows.
    h = pinned.linear(x, self.width, precision="auto", name="w_in",
                      with_bias=True)
    b, t, _ = h.shape
    if cache is None:
      ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
      seen = (jnp.tril(jnp.ones((t, t), bool))[None]
              & (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0))
      total = jnp.einsum("bts,bsw->btw", seen.astype(h.dtype), h,
                         precision=precision.for_dtype("auto", h.dtype))
      count = seen.sum(-1, keepdims=True).astype(h.dtype)
      new_cache = None
    else:
      total = cache.total[:, None] + jnp.cumsum(h, axis=1)
      count = (cache.count[:, None, None]
               + jnp.arange(1, t + 1, dtype=h.dtype)[None, :, None])
      new_cache = MeanCache(total=total[:, -1], count=cache.count + t)
    y = pinned.linear(total / jnp.maximum(count, 1.0), x.shape[-1],
                      precision="auto", name="w_out", with_bias=True)
    if segment_ids is not None:
      y = jnp.where((segment_ids > 0)[..., None], y, 0.0)
    return y, new_cache


def _validate(keywords):
  checks.int_at_least("width", keywords["width"], 1)


TOY = mixer.Mixer(
    name="toy_mean", section="toy_mean",
    build=lambda keywords, name: CumulativeMean(**keywords, name=name),
    init_cache=lambda batch, max_len, keywords: MeanCache(
        total=jnp.zeros((batch, keywords["width"])),
        count=jnp.zeros((batch,))),
    validate=_validate,
    capabilities=mixer.Capabilities(recurrent_state=True, op_backend=False,
                                    context_parallel=False))


# --- the tests ---------------------------------------------------------------


@pytest.fixture(name="toy")
def _toy():
  registry.register(TOY)  # the one registry line
  try:
    yield TOY
  finally:
    registry.unregister(TOY.name)


def _config(mixer_name, **diff):
  config = mqar.get_config("smoke")
  with config.unlocked():
    config.model.toy_mean = ml_collections.ConfigDict(dict(width=16))
  return config_lib.apply_diff(config, {"model.mixer": mixer_name, **diff})


@pytest.mark.parametrize("pattern,layers", [("toy_mean", 1),
                                            ("toy_mean,attention", 2)])
def test_a_registered_mixer_trains_through_the_config_path(
    toy, tmp_path, pattern, layers):
  config = _config(pattern, **{"model.num_layers": layers,
                               "train.num_steps": 4})
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["mixer"] == pattern and summary["steps"] == 4
  assert summary["backend"] is None  # no layer takes a KDA op backend
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["model"]["toy_mean"] == {"width": 16}
  with open(tmp_path / "metrics.jsonl") as f:
    train_losses = [r["loss"] for r in map(json.loads, f)
                    if r["split"] == "train"]
  assert len(train_losses) == 4 and np.all(np.isfinite(train_losses))
  # Its parameters are the toy's own, under each layer's name.
  params = jax.eval_shape(model_lib.make_model(config.model, 32).init,
                          jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  assert params["lm/mixer_0/w_in"]["w"].shape == (32, 16)
  del toy


def test_its_cache_continues_the_sequence_like_the_full_forward(toy):
  model = _config("toy_mean,attention", **{"model.num_layers": 2}).model
  f = model_lib.make_model(model, 32)
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, 32)
  params = f.init(jax.random.key(0), tokens)
  full = f.apply(params, tokens)
  cache = model_lib.init_cache(model, 2, max_len=11)
  logits, cache = f.apply(params, tokens[:, :7], None, cache)  # prefill
  pieces = [logits]
  for t in range(7, 11):
    logits, cache = f.apply(params, tokens[:, t:t + 1], None, cache)
    pieces.append(logits)
  testing.assert_close(jnp.concatenate(pieces, axis=1), full,
                       rtol=testing.RTOL[np.dtype("float32")], name="logits")
  # Both paths' matmuls keep their precision under any process default, in
  # the program a TPU compiles (read on any host: tests/lowered.py).
  lowered.pinned(f.apply, params, tokens)
  lowered.pinned(lambda p, x, c: f.apply(p, x, None, c), params,
                 tokens[:, :7], model_lib.init_cache(model, 2, max_len=11))
  # The attention layer's buffer bounds the cache; the toy's does not.
  assert model_lib.cache_positions(cache) == 11
  del toy


def test_code_above_asks_its_capabilities(toy):
  config = _config("toy_mean", **{"mesh.context": 2})
  with pytest.raises(NotImplementedError, match="layer of mixer 'toy_mean',"
                     " which has no context parallelism"):
    program_lib.validate_config(config)
  with pytest.raises(ValueError, match="model.toy_mean: width must be an int"):
    model_lib.validate_model_config(
        _config("toy_mean", **{"model.toy_mean.width": 0}).model, 32)
  assert model_lib.sections_with(_config("toy_mean").model, "op_backend") == ()
  with pytest.raises(ValueError, match="already registered"):
    registry.register(toy)
  with pytest.raises(ValueError, match="built in"):
    registry.unregister("kda")
  del toy


def test_an_unregistered_name_is_refused_naming_the_registry():
  assert "toy_mean" not in registry.names()
  config = config_lib.apply_diff(mqar.get_config("smoke"),
                                 {"model.mixer": "toy_mean"})
  with pytest.raises(ValueError, match="model.mixer must be one of"):
    program_lib.validate_config(config)
