"""Haiku modules (hk.Module) built on `linear_attention.ops`.

The sequence mixers share one contract (`mixer.py`) and one registry of
config names (`registry.py`).
"""

from linear_attention.modules.attention import AttentionCache
from linear_attention.modules.attention import ShortConvSoftmaxAttention
from linear_attention.modules.attention import init_attention_cache
from linear_attention.modules.csa_indexer import CompressedSparseIndexer
from linear_attention.modules.kda import KDACache
from linear_attention.modules.kda import KimiDeltaAttention
from linear_attention.modules.kda import init_kda_cache
from linear_attention.modules.mixer import Capabilities
from linear_attention.modules.mixer import Mixer
from linear_attention.modules.short_conv import ShortConvolution
