"""Cached generation: a prefill of the prompt, then one token at a time.

Every mixer keeps a constant-cost decode state: KDA and GDN their
recurrent state and conv tails (`KDACache`), attention its key/value buffer
(`AttentionCache`, which grows with the context), hybrids one per layer
(`experiments.training.model.init_cache`). `generate` runs the prefill and the
decode steps in one jitted function (`lax.scan` over the new tokens);
`continue_text` does it for a trained text run (CLI `experiments.generate`).
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import tasks as tasks_lib
from experiments.training import checkpoints
from experiments.training import model as model_lib
from experiments.training import program as program_lib


def sample(logits: jax.Array, key: jax.Array, *, temperature: float,
           top_k: int) -> jax.Array:
  """[B, V] logits -> [B] int32 tokens: argmax at temperature 0, else a draw
  from softmax(logits / temperature) over the `top_k` largest (0: all)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def check_sampling(temperature: float, top_k: int) -> None:
  """ValueError naming the field for a bad sampling setting."""
  if not isinstance(temperature, (int, float)) or not 0 <= temperature < float(
      "inf"):
    raise ValueError(f"temperature must be a finite number >= 0; got"
                     f" {temperature!r}.")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k must be an int >= 0 (0: no cut); got {top_k!r}.")


@functools.partial(jax.jit, static_argnames=(
    "apply", "max_new_tokens", "temperature", "top_k"))
def generate(apply, params, cache, prompt: jax.Array, key: jax.Array, *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0):
  """prompt [B, P] int32 -> [B, max_new_tokens] int32 new tokens.

  Args:
    apply: the model's `apply(params, tokens, segment_ids, cache)` (with a
      cache it returns (logits, new_cache)).
    params: the model's parameters.
    cache: the empty cache (`model.init_cache`) for P + max_new_tokens
      positions at least.
    prompt: the tokens to continue.
    key: the sampling key (unused when greedy).
    max_new_tokens, temperature, top_k: see `sample`.
  """
  need = prompt.shape[1] + max_new_tokens
  held = model_lib.cache_positions(cache)
  if held is not None and held < need:
    raise ValueError(
        f"the cache holds {held} positions (init_cache's max_len), fewer than"
        f" the prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens})"
        f" = {need}.")
  logits, cache = apply(params, prompt, None, cache)
  first = sample(logits[:, -1], key, temperature=temperature, top_k=top_k)

  def step(carry, key):
    cache, token = carry
    logits, cache = apply(params, token[:, None], None, cache)
    nxt = sample(logits[:, -1], key, temperature=temperature, top_k=top_k)
    return (cache, nxt), token

  keys = jax.random.split(jax.random.fold_in(key, 1), max_new_tokens)
  _, tokens = jax.lax.scan(step, (cache, first), keys)
  return jnp.moveaxis(tokens, 0, 1)


def load_run(workdir: str):
  """(config, model, params, step) of a run's latest checkpoint."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"--workdir {workdir!r} holds no config.json (not a"
                     " run directory).")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  task = tasks_lib.make_task(**config.task.to_dict())
  model = model_lib.make_model(config.model, task.vocab_size)
  params = model.init(jax.random.key(config.seed),
                      jnp.zeros((1, 8), jnp.int32))
  optimizer, _ = program_lib.make_optimizer(config.train)
  params, step = checkpoints.latest_params(workdir, params,
                                           optimizer.init(params))
  return config, model, params, step


def continue_text(workdir: str, prompt: str, *, max_new_tokens: int,
                  temperature: float, top_k: int, seed: int) -> str:
  """The run's continuation of `prompt` (bytes decoded as UTF-8)."""
  check_sampling(temperature, top_k)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
  tokens = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32)
  if not len(tokens):
    raise ValueError("--prompt must hold at least one byte.")
  config, model, params, _ = load_run(workdir)
  if config.task.name != "text":
    raise ValueError(f"the run in {workdir!r} trained on task"
                     f" {config.task.name!r}; generation takes a 'text' run.")
  cache = model_lib.init_cache(config.model, 1,
                               max_len=len(tokens) + max_new_tokens)
  with model_lib.host_context(config.model):
    out = generate(
        model.apply, params, cache, jnp.asarray(tokens[None]),
        jax.random.key(seed), max_new_tokens=max_new_tokens,
        temperature=float(temperature), top_k=top_k)
  return bytes(np.asarray(out[0], np.uint8)).decode("utf-8",
                                                    errors="replace")
