"""Haiku modules (hk.Module) built on `linear_attention.ops`."""

from linear_attention.modules.csa_indexer import CompressedSparseIndexer
from linear_attention.modules.kda import KDACache
from linear_attention.modules.kda import KimiDeltaAttention
from linear_attention.modules.kda import init_kda_cache
from linear_attention.modules.short_conv import ShortConvolution
