"""Cached generation: a prefill of the prompt, then one token at a time.

Every mixer keeps a constant-cost decode state: KDA and GDN their
recurrent state and conv tails (`KDACache`), attention its key/value buffer
(`AttentionCache`, which grows with the context), hybrids one per layer
(`experiments.model.init_cache`). `generate` runs the prefill and the
decode steps in one jitted function (`lax.scan` over the new tokens).
"""

import functools

import jax
import jax.numpy as jnp


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
