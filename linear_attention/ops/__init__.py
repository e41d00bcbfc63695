"""Pure functions on arrays (no Haiku). Public ops take and return [B, T, H, *]."""

from linear_attention.ops.kda.api import Backend
from linear_attention.ops.kda.api import kimi_delta_attention
from linear_attention.ops.short_conv import short_conv1d

__all__ = ["Backend", "kimi_delta_attention", "short_conv1d"]
