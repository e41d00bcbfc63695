"""The LM and its mixers: shapes, causality, and that the ablation is one."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common as config_lib
from configs import mqar
from experiments.training import model as model_lib

T, V = 16, 32


def _model(mixer):
  config = config_lib.apply_diff(mqar.get_config("smoke"),
                                 {"model.mixer": mixer})
  return model_lib.make_model(config.model, V)


@pytest.mark.parametrize("mixer", model_lib.MIXERS)
def test_mixers_are_causal_and_only_memory_mixers_see_the_past(mixer):
  model = _model(mixer)
  tokens = jax.random.randint(jax.random.key(1), (3, T), 1, V)
  # Row 1 changes the future (t >= 10), row 2 the past (t < 5), of row 0.
  tokens = tokens.at[1].set(tokens[0].at[10:].set((tokens[0, 10:] + 7) % V))
  tokens = tokens.at[2].set(tokens[0].at[:5].set((tokens[0, :5] + 3) % V))
  params = model.init(jax.random.key(0), tokens)
  logits = jax.jit(model.apply)(params, tokens)
  chex.assert_shape(logits, (3, T, V))
  chex.assert_tree_all_finite(logits)
  # Changing the future must not change the past (causality) ...
  np.testing.assert_allclose(logits[1, :10], logits[0, :10],
                             rtol=1e-5, atol=1e-6)
  # ... and changing the past changes the present only through a live mixer.
  logits_past = logits[2:]
  logits = logits[:1]
  moved = float(jnp.max(jnp.abs(logits_past[:, 5:] - logits[:, 5:])))
  if mixer in ("kda_zeroed", "none"):
    # exact: one program; the zeroed mixer's output times a literal 0.0
    # (no mixer for "none") leaves each position's own arithmetic.
    assert moved == 0.0, moved
  else:
    assert moved > 1e-4, moved


def test_zeroed_kda_has_the_same_parameters_as_kda_and_gdn_a_head_decay():
  tokens = jnp.zeros((1, T), jnp.int32)
  shapes = {m: jax.tree.map(jnp.shape, jax.eval_shape(
      _model(m).init, jax.random.key(0), tokens))
            for m in ("kda", "kda_zeroed", "gdn")}
  assert shapes["kda"] == shapes["kda_zeroed"]
  kda_layer, gdn_layer = (shapes[m]["lm/mixer_0"] for m in ("kda", "gdn"))
  assert kda_layer["dt_bias"] == (2 * 16,) and gdn_layer["dt_bias"] == (2,)


def test_bad_model_config_names_the_field():
  config = mqar.get_config("smoke")
  with pytest.raises(ValueError, match="model.mixer"):
    model_lib.make_model(config_lib.apply_diff(
        config, {"model.mixer": "kda_zero"}).model, V)
  with pytest.raises(ValueError, match="decay"):
    model_lib.make_model(config_lib.apply_diff(
        config, {"model.kda.decay": "token"}).model, V)
  with pytest.raises(ValueError, match="model.kda.decayy"):
    config_lib.apply_diff(config, {"model.kda.decayy": "head"})

