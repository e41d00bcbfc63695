"""The call the CSA score's backends are asked about (`supports`) and run."""

from typing import Any, NamedTuple

import jax

from linear_attention.ops import backends


class Call(NamedTuple):
  """One validated call of `csa_streamindex_score` (positions filled in)."""

  q: jax.Array  # [B, S, H, D]
  k_compressed: jax.Array  # [B, W, D]
  weights: jax.Array  # [B, S, H]
  softmax_scale: float
  q_positions: jax.Array  # [B, S] int
  block_last_positions: jax.Array  # [B, W] int
  q_segment_ids: jax.Array | None  # [B, S] int
  kv_segment_ids: jax.Array | None  # [B, W] int
  precision: jax.lax.Precision  # of the q . k products and their gradients
  options: dict[str, Any]  # the tuning arguments given (not None)
  target: backends.Target

  def score_kwargs(self) -> dict[str, Any]:
    """The keyword arguments every backend's score function takes."""
    return dict(softmax_scale=self.softmax_scale,
                q_positions=self.q_positions,
                block_last_positions=self.block_last_positions,
                q_segment_ids=self.q_segment_ids,
                kv_segment_ids=self.kv_segment_ids,
                precision=self.precision)

  def run(self, score_fn):
    """`score_fn(q, k_compressed, weights, **score_kwargs, **options)`."""
    return score_fn(self.q, self.k_compressed, self.weights,
                    **self.score_kwargs(), **self.options)
