"""DeepSeek-V4 CSA StreamIndex indexer score: reference, XLA tiles, Pallas."""

from linear_attention.ops.csa.api import BACKENDS
from linear_attention.ops.csa.api import csa_streamindex_score
from linear_attention.ops.csa.api import csa_streamindex_score_sharded

__all__ = ["BACKENDS", "csa_streamindex_score", "csa_streamindex_score_sharded"]
