"""Pure functions on arrays (no Haiku). Public ops take and return [B, T, H, *]."""

from linear_attention.ops.csa.api import csa_streamindex_score
from linear_attention.ops.csa.api import csa_streamindex_score_sharded
from linear_attention.ops.kda.api import kimi_delta_attention
from linear_attention.ops.short_conv import short_conv1d

__all__ = [
    "csa_streamindex_score",
    "csa_streamindex_score_sharded",
    "kimi_delta_attention",
    "short_conv1d",
]
