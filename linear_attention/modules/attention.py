"""Causal softmax attention with a short conv on q, k and v, and its KV cache.

The attention mixer (`MIXER`, config name "attention"): the fair baseline of
the synthetic tasks (the same short conv and SiLU on q, k and v as the KDA
layer; without the conv it sat at the 1/N plateau on MQAR), and, with
`rope=False`, Kimi Linear's global attention layer (arXiv 2510.26692, §4:
no positional encoding, KDA carries position).

    q, k, v = SiLU(ShortConv(x W_q)), SiLU(ShortConv(x W_k)), SiLU(ShortConv(x W_v))
    q, k    = RoPE(q), RoPE(k)                  (rope=True)
    o       = softmax(q k^T / sqrt(Dh) + mask) v
    y       = o W_out

The mask is causal and, with `segment_ids`, keeps each token to its own
packed document (padding outputs zero). Every matmul (the projections, q k^T
and the weighted sum of v) runs at the layer's `precision`
(`linear_attention.ops.precision`: "auto" is float32-exact for float32
activations, one bfloat16 pass for bfloat16), whatever
`jax.default_matmul_precision` says; the scores are the computation of
`jax.nn.dot_product_attention(implementation="xla")`, which takes no
precision, written out with it pinned.

The mixer contract (`linear_attention.modules.mixer`): `layer(x, *,
segment_ids=None, cache=None) -> (y, new_cache or None)`. Decoding:
`init_attention_cache(...)` holds the conv tails and a key/value buffer of
`max_len` positions; `layer(x, cache=cache)` writes the new keys at
`cache.length` and attends over the positions written so far. No context
parallelism (a query needs every key before it).
"""

import dataclasses
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.modules import mixer
from linear_attention.modules import pinned
from linear_attention.modules import short_conv
from linear_attention.ops import checks
from linear_attention.ops import precision as precision_lib

WEIGHT_STDDEV = 0.02  # as the KDA layer


class AttentionCache(NamedTuple):
  """Decode cache of one attention layer (zeros = a new sequence).

  q_conv, k_conv, v_conv: [B, W - 1, H * Dh], the short convs' last inputs
    (width 0 when conv_size <= 1).
  k, v: [B, S, H, Dh] keys (after RoPE) and values of positions 0 .. S - 1;
    only the first `length` are real.
  length: [] int32, the tokens seen so far (the next token's position).
  """
  q_conv: jax.Array
  k_conv: jax.Array
  v_conv: jax.Array
  k: jax.Array
  v: jax.Array
  length: jax.Array

  @property
  def max_positions(self) -> int:
    """The positions the key/value buffer holds (`init_cache`'s max_len)."""
    return self.k.shape[1]


def validate_attention_args(*, num_heads: int, head_dim: int,
                            conv_size: int = 4, rope_base: float = 10_000.0,
                            rope: bool = True, precision: str = "auto"
                            ) -> None:
  """Raises ValueError, naming the argument, unless the layer can be built."""
  checks.int_at_least("num_heads", num_heads, 1)
  checks.int_at_least("head_dim", head_dim, 1)
  if head_dim % 2:
    raise ValueError(f"head_dim must be even (RoPE); got {head_dim}.")
  checks.int_at_least("conv_size", conv_size, 0,
                      note=" (0 turns the short conv off)")
  checks.positive_number("rope_base", rope_base)
  checks.boolean("rope", rope)
  precision_lib.validate(precision)


def init_attention_cache(batch_size: int, *, num_heads: int, head_dim: int,
                         conv_size: int, max_len: int,
                         dtype=jnp.float32) -> AttentionCache:
  """An all-zero `AttentionCache` for up to `max_len` positions."""
  checks.int_at_least("max_len", max_len, 1)
  width = max(conv_size - 1, 0)
  tail = jnp.zeros((batch_size, width, num_heads * head_dim), dtype)
  kv = jnp.zeros((batch_size, max_len, num_heads, head_dim), dtype)
  return AttentionCache(q_conv=tail, k_conv=tail, v_conv=tail, k=kv, v=kv,
                        length=jnp.zeros((), jnp.int32))


def rope(x: jax.Array, base: float, offset=0) -> jax.Array:
  """Rotary embedding on [B, T, H, Dh] at positions offset, offset + 1, ...

  The angles in float32, the rotation in float32 (x's dtype if wider), the
  result in x's dtype: a bfloat16 q or k stays bfloat16. (Returned in
  float32, it made a bfloat16 model's attention, `out` projection and the
  residual stream after it float32 against bfloat16 weights: mixed
  (float32, bfloat16) dots, at HIGHEST, in the TPU's lowering.)
  """
  _, t, _, dh = x.shape
  half = dh // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  positions = offset + jnp.arange(t, dtype=jnp.float32)
  angles = positions[:, None] * freqs[None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
  return rotated.astype(x.dtype)


@dataclasses.dataclass
class ShortConvSoftmaxAttention(hk.Module):
  """Causal softmax attention, [B, T, D] -> [B, T, D] (module docstring)."""

  num_heads: int  # H
  head_dim: int  # Dh (even, for RoPE)
  conv_size: int = 4  # W taps of the short conv; 0 = no conv, SiLU only
  rope_base: float = 10_000.0  # RoPE wavelength base
  rope: bool = True  # False: no positional encoding (Kimi Linear's NoPE)
  # Matmul precision of every product ("auto": float32-exact for float32
  # activations, one bfloat16 pass for bfloat16; linear_attention/ops/
  # precision.py).
  precision: str = "auto"
  name: str | None = None

  def __post_init__(self):
    validate_attention_args(
        num_heads=self.num_heads, head_dim=self.head_dim,
        conv_size=self.conv_size, rope_base=self.rope_base, rope=self.rope,
        precision=self.precision)
    super().__post_init__()  # hk.Module.__init__(name=self.name)

  def init_cache(self, batch_size: int, max_len: int,
                 dtype=jnp.float32) -> AttentionCache:
    return init_attention_cache(
        batch_size, num_heads=self.num_heads, head_dim=self.head_dim,
        conv_size=self.conv_size, max_len=max_len, dtype=dtype)

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               cache: AttentionCache | None = None):
    """(y [B, T, D], new_cache, or None without `cache`).

    `segment_ids` [B, T] (1-indexed documents, 0 = padding) keep attention
    inside each document; with a cache they are not taken (decoding runs
    one sequence per row).
    """
    b, t, d = x.shape
    h, dh = self.num_heads, self.head_dim
    if cache is not None and segment_ids is not None:
      raise ValueError("segment_ids are not taken with a cache: decoding"
                       " runs one sequence per row.")
    tails = (None,) * 3 if cache is None else cache[:3]
    qkv, new_tails = [], []
    prec = precision_lib.for_dtype(self.precision, x.dtype)
    for name, tail in zip("qkv", tails):
      y = pinned.linear(x, h * dh, precision=self.precision,
                        name=f"{name}_proj",
                        w_init=hk.initializers.RandomNormal(WEIGHT_STDDEV))
      if self.conv_size > 0:
        y = short_conv.ShortConvolution(self.conv_size, activation="silu",
                                        name=f"{name}_conv1d")(
                                            y, segment_ids=segment_ids,
                                            cache=tail)
        if tail is not None:
          y, tail = y
      else:
        y = jax.nn.silu(y)
      new_tails.append(tail)
      qkv.append(y.reshape(b, t, h, dh))
    q, k, v = qkv
    offset = 0 if cache is None else cache.length
    if self.rope:
      q, k = rope(q, self.rope_base, offset), rope(k, self.rope_base, offset)
    if cache is None:
      o = attend(q, k, v, _training_mask(t, segment_ids), prec)
      new_cache = None
    else:
      keys = jax.lax.dynamic_update_slice(
          cache.k, k.astype(cache.k.dtype), (0, cache.length, 0, 0))
      values = jax.lax.dynamic_update_slice(
          cache.v, v.astype(cache.v.dtype), (0, cache.length, 0, 0))
      seen = jnp.arange(cache.k.shape[1])[None, :] <= (
          cache.length + jnp.arange(t))[:, None]  # [T, S]
      o = attend(q, keys.astype(q.dtype), values.astype(q.dtype),
                 seen[None, None], prec)
      new_cache = AttentionCache(*new_tails, k=keys, v=values,
                                 length=cache.length + t)
    if segment_ids is not None:
      o = jnp.where((segment_ids > 0)[..., None, None], o, 0.0)
    y = pinned.linear(o.reshape(b, t, h * dh), d, precision=self.precision,
                      name="out",
                      w_init=hk.initializers.RandomNormal(WEIGHT_STDDEV))
    return y, new_cache


def _training_mask(t, segment_ids):
  """[B or 1, 1, T, T]: causal, and same document with `segment_ids`.

  A padding token (id 0) sees the padding before it (never a document), so
  no row of the mask is empty; its output is zeroed by the caller.
  """
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  if segment_ids is None:
    return causal
  same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  return causal & same


def attend(q, k, v, mask, precision: jax.lax.Precision):
  """softmax(q k^T / sqrt(Dh), masked) v on [B, T, H, Dh] / [B, S, H, Dh].

  `jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")`
  step for step (the same numbers), with both products at `precision`:
  logits in float32 (float64 for float64 inputs), masked entries set to
  -0.7 x the float32 maximum, the softmax in float32, its weights in k's
  dtype. `mask` [B or 1, H or 1, T, S] bool.
  """
  logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
  logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=precision,
                      preferred_element_type=logits_dtype)
  logits = logits * jnp.array(1.0 / np.sqrt(q.shape[-1]), logits_dtype)
  large_negative = jnp.asarray(-0.7 * np.finfo(np.float32).max, logits_dtype)
  logits = jnp.where(mask, logits, large_negative)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", weights.astype(k.dtype), v,
                    precision=precision)


MIXER = mixer.Mixer(
    name="attention", section="attention",
    build=lambda keywords, name: ShortConvSoftmaxAttention(**keywords,
                                                           name=name),
    init_cache=lambda batch_size, max_len, kw: init_attention_cache(
        batch_size, num_heads=kw["num_heads"], head_dim=kw["head_dim"],
        conv_size=kw["conv_size"], max_len=max_len),
    validate=lambda keywords: validate_attention_args(**keywords),
    capabilities=mixer.Capabilities(recurrent_state=False, op_backend=False,
                                    context_parallel=False))
