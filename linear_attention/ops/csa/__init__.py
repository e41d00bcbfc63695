"""DeepSeek-V4 CSA StreamIndex indexer score: reference, XLA tiles, Pallas."""

from linear_attention.ops.csa.api import Backend
from linear_attention.ops.csa.api import csa_streamindex_score
from linear_attention.ops.csa.api import csa_streamindex_score_sharded

__all__ = ["Backend", "csa_streamindex_score", "csa_streamindex_score_sharded"]
