"""Cached decoding and generation against the full forward, for every mixer.

The cache is checked against the model without one: the logits of a prefill
then token-by-token decoding equal the full forward's at every position, and
greedy generation picks, at every step, the argmax of recomputing the whole
sequence (up to ties within the two programs' float32 differences).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common as config_lib
from configs import text as text_config
from experiments.tools import generation
from experiments.training import model as model_lib
from linear_attention import testing

VOCAB = 24
MODELS = {  # name: (model.mixer, layers, attention.rope)
    "kda": ("kda", 2, True),
    "gdn": ("gdn", 2, True),
    "attention": ("attention", 2, True),
    "attention_nope": ("attention", 2, False),
    "hybrid": ("kda,kda,kda,attention", 4, False),
}


def _model(name):
  mixer, layers, rope = MODELS[name]
  model = config_lib.model_config(mixer=mixer, num_layers=layers, d_model=32,
                                  mlp_hidden=48, num_heads=2, head_dim=8,
                                  conv_size=3)
  model.attention.rope = rope
  return model


def _params(model, seed=0):
  """Initial parameters plus noise: logits far from uniform (no near-ties)."""
  f = model_lib.make_model(model, VOCAB)
  params = f.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  noisy = [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
  return f, jax.tree.unflatten(tree, noisy)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cached_decoding_gives_the_full_forwards_logits(name):
  model = _model(name)
  f, params = _params(model)
  tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, VOCAB)
  full = jax.jit(f.apply)(params, tokens)
  cache = model_lib.init_cache(model, 2, max_len=13)
  step = jax.jit(lambda p, x, c: f.apply(p, x, None, c))
  logits, cache = step(params, tokens[:, :5], cache)  # prefill
  pieces = [logits]
  for i in range(5, 13):  # then one token at a time
    logits, cache = step(params, tokens[:, i:i + 1], cache)
    pieces.append(logits)
  cached = jnp.concatenate(pieces, axis=1)
  for i in range(13):
    testing.assert_close(cached[:, i], full[:, i], rtol=1e-5,
                         name=f"{name} logits at {i}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kda", "attention", "hybrid"])
def test_greedy_generation_is_the_full_recomputation(name):
  model = _model(name)
  f, params = _params(model, seed=3)
  prompt = jax.random.randint(jax.random.key(4), (2, 6), 0, VOCAB)
  n = 10
  cache = model_lib.init_cache(model, 2, max_len=6 + n)
  got = np.asarray(generation.generate(f.apply, params, cache, prompt,
                                       jax.random.key(0), max_new_tokens=n))
  seq = np.asarray(prompt)
  apply = jax.jit(f.apply)
  rows = np.arange(seq.shape[0])
  for i in range(n):  # no cache: the whole sequence for every new token
    logits = np.asarray(apply(params, jnp.asarray(seq))[:, -1], np.float64)
    # Two compiled programs, so greedy tokens are compared up to ties: the
    # cached logits are within relative L2 1e-5 of the full forward's
    # (test_cached_decoding_gives_the_full_forwards_logits), so each entry
    # within d = 1e-5 ||row||, and the cached argmax scores >= max - 2 d here.
    # Where the top-2 gap exceeds 2 d, that is exactly the argmax.
    tol = 2 * 1e-5 * np.linalg.norm(logits, axis=-1)
    short = logits.max(-1) - logits[rows, got[:, i]]
    assert np.all(short <= tol), (i, got[:, i], logits.argmax(-1), short, tol)
    seq = np.concatenate([seq, got[:, i:i + 1]], axis=1)  # the cached path's


def test_sampling_keeps_to_the_top_k_and_is_seeded():
  logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.3, 0.4]] * 512))
  draw = lambda seed, k: np.asarray(generation.sample(
      logits, jax.random.key(seed), temperature=1.0, top_k=k))
  assert set(draw(0, 2)) == {2, 3}
  assert set(draw(0, 0)) == {0, 1, 2, 3}
  # exact: the same compiled sample on the same logits and key, twice.
  np.testing.assert_array_equal(draw(5, 0), draw(5, 0))
  counts = np.bincount(draw(1, 0), minlength=4) / 512
  np.testing.assert_allclose(counts, [0.1, 0.2, 0.3, 0.4], atol=0.06)
  with pytest.raises(ValueError, match="temperature"):
    generation.check_sampling(-1.0, 0)
  with pytest.raises(ValueError, match="top_k"):
    generation.check_sampling(1.0, -2)


def test_attention_keeps_packed_documents_apart():
  # Two documents packed in a row give each document's own outputs.
  model = _model("attention")
  f, params = _params(model, seed=5)
  a = jax.random.randint(jax.random.key(6), (1, 7), 0, VOCAB)
  b = jax.random.randint(jax.random.key(7), (1, 5), 0, VOCAB)
  packed = jnp.concatenate([a, b, jnp.zeros((1, 2), jnp.int32)], axis=1)
  ids = jnp.asarray([[1] * 7 + [2] * 5 + [0] * 2])
  out = f.apply(params, packed, ids)
  testing.assert_close(out[:, :7], f.apply(params, a), rtol=1e-5, name="a")
  testing.assert_close(out[:, 7:12], f.apply(params, b), rtol=1e-5, name="b")


def test_a_bad_mixer_pattern_names_the_field():
  model = _model("hybrid")
  model.num_layers = 6
  with pytest.raises(ValueError, match="model.num_layers"):
    model_lib.make_model(model, VOCAB)
  model.mixer = "kda,softmax"
  with pytest.raises(ValueError, match="model.mixer"):
    model_lib.make_model(model, VOCAB)


def test_generation_refuses_a_cache_too_short_or_a_run_without_checkpoint(
    tmp_path):
  model = _model("hybrid")
  f, params = _params(model)
  prompt = jnp.zeros((1, 6), jnp.int32)
  short = model_lib.init_cache(model, 1, max_len=15)
  with pytest.raises(ValueError, match=r"max_len.*\(6\).*\(10\) = 16"):
    generation.generate(f.apply, params, short, prompt, jax.random.key(0),
                        max_new_tokens=10)
  assert model_lib.cache_positions(short) == 15
  # KDA's state has no length bound.
  assert model_lib.cache_positions(
      model_lib.init_cache(_model("kda"), 1, max_len=1)) is None
  # A run directory with its config but no checkpoint yet.
  with open(tmp_path / "config.json", "w") as fh:
    json.dump(text_config.get_config("smoke").to_dict(), fh)
  with pytest.raises(ValueError, match="no checkpoint"):
    generation.load_run(str(tmp_path))
  with pytest.raises(ValueError, match="no config.json"):
    generation.load_run(str(tmp_path / "missing"))
