"""The CSA StreamIndex indexer score as one einsum: the readable oracle.

DeepSeek-V4 Compressed Sparse Attention indexer (DeepSeek-V4 inference code,
`Indexer.forward`; MaxText `kernels/attention/csa_streamindex.py`):

    score[b, s, w] = c sum_h weights[b, s, h] relu(q[b, s, h, :] . k[b, w, :])

with c = softmax_scale. Block w is visible to query s iff

    block_last_positions[b, w] <= q_positions[b, s]
    and q_segment_ids[b, s] == kv_segment_ids[b, w]   (when segments are given)

and invisible entries are -inf (their gradient is zero). This file holds the
whole [B, S, H, W] product in memory: use it to read and to check, not to
train at long S.
"""

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.csa import common

NAME = "reference"
OPTIONS = ()  # tuning arguments it takes
supports_target = supports = backends.no_limit  # plain XLA: every call


def run(call: common.Call):
  return call.run(score_reference)


def visible_mask(q_positions, block_last_positions, q_segment_ids=None,
                 kv_segment_ids=None):
  """[B, S, W] bool: block w is visible to query s (the causal rule above)."""
  mask = block_last_positions[:, None, :] <= q_positions[:, :, None]
  if q_segment_ids is not None:
    mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  return mask


def score_reference(q, k_compressed, weights, *, softmax_scale, q_positions,
                    block_last_positions, precision, q_segment_ids=None,
                    kv_segment_ids=None):
  """See `linear_attention.ops.csa_streamindex_score`; float32 [B, S, W].

  q . k at `precision` (a `jax.lax.Precision`); the head sum over float32
  relu(A) at HIGHEST. Gradients come from autodiff: `jax.nn.relu` has
  derivative 1[A > 0], and `jnp.where` sends a zero cotangent to the masked
  entries.
  """
  a = jnp.einsum("bshd,bwd->bshw", q, k_compressed,
                 preferred_element_type=jnp.float32, precision=precision)
  s = jnp.einsum("bsh,bshw->bsw", weights.astype(jnp.float32), jax.nn.relu(a),
                 precision=jax.lax.Precision.HIGHEST)
  mask = visible_mask(q_positions, block_last_positions, q_segment_ids,
                      kv_segment_ids)
  return jnp.where(mask, softmax_scale * s, -jnp.inf)
