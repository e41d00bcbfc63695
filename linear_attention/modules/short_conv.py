"""`ShortConvolution`: Haiku owner of the taps of `ops.short_conv1d`.

Kimi Linear (arXiv 2510.26692, §4) applies a width-4 depthwise causal
convolution and SiLU to q, k and v. The math, the segment rules and the cache
contract are in `linear_attention.ops.short_conv`.
"""

import haiku as hk
import jax
import jax.numpy as jnp

from linear_attention.ops import checks
from linear_attention.ops import short_conv as short_conv_op


class ShortConvolution(hk.Module):
  """Causal depthwise convolution over time; channels C come from the input.

  Parameters: `w` [W, C] (w[-1] multiplies the current token), initialised
  U(-1/sqrt(W), 1/sqrt(W)) like PyTorch's `nn.Conv1d` (fan-in W for a
  depthwise filter), which fla's `ShortConvolution` keeps; optional `b` [C],
  zeros.
  """

  def __init__(self, kernel_size: int, *, use_bias: bool = False,
               activation: str | None = "silu", name: str | None = None):
    """Args:
      kernel_size: W >= 1, the number of taps.
      use_bias: whether to add a learned per-channel bias before activation.
      activation: "silu" or None.
      name: module name.
    """
    super().__init__(name=name)
    checks.int_at_least("kernel_size", kernel_size, 1)
    checks.one_of("activation", activation, short_conv_op.ACTIVATIONS)
    self.kernel_size = kernel_size
    self.use_bias = use_bias
    self.activation = activation

  def init_cache(self, batch_size: int, channels: int,
                 dtype=jnp.float32) -> jax.Array:
    """Zeros [B, W - 1, C]: the cache at the start of a sequence."""
    return jnp.zeros((batch_size, self.kernel_size - 1, channels), dtype)

  def __call__(
      self, x: jax.Array, *, segment_ids: jax.Array | None = None,
      cache: jax.Array | None = None, context_axis: str | None = None,
  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """[B, T, C] -> y [B, T, C]; with `cache` [B, W-1, C]: (y, new_cache).

    `context_axis`: the mesh axis T is split over inside `jax.shard_map`
    (see `ops.short_conv1d`), or None.
    """
    c = x.shape[-1]
    bound = self.kernel_size ** -0.5
    w = hk.get_parameter("w", (self.kernel_size, c), jnp.float32,
                         init=hk.initializers.RandomUniform(-bound, bound))
    bias = (hk.get_parameter("b", (c,), jnp.float32, init=jnp.zeros)
            if self.use_bias else None)
    return short_conv_op.short_conv1d(
        x, w, segment_ids=segment_ids, cache=cache,
        activation=self.activation, bias=bias, context_axis=context_axis)
