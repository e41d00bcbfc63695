"""`RMSNorm` over the last axis with float32 statistics (per-head use in KDA).

    y = x / sqrt(mean(x^2) + eps) * scale

Why not `hk.RMSNorm`: it creates its scale in the input's dtype (a bfloat16
parameter for bfloat16 activations) and takes the mean of squares in that
dtype. Kimi Linear's output norm (arXiv 2510.26692, §4; fla's
`FusedRMSNormGated`) keeps a float32 weight and float32 statistics; this
module does that and casts the result back to the input dtype.
"""

import haiku as hk
import jax
import jax.numpy as jnp


class RMSNorm(hk.Module):
  """RMS normalisation over the last axis; `scale` [C] float32, init ones."""

  def __init__(self, eps: float = 1e-5, name: str | None = None):
    """Args:
      eps: added to the mean of squares (fla's default 1e-5).
      name: module name.
    """
    super().__init__(name=name)
    if not eps > 0:
      raise ValueError(f"eps must be > 0; got {eps!r}.")
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., C] -> [..., C] in x.dtype."""
    scale = hk.get_parameter("scale", x.shape[-1:], jnp.float32,
                             init=jnp.ones)
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (xf * inv * scale).astype(x.dtype)
