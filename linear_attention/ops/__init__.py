"""Pure functions on arrays (no Haiku). Public ops take and return [B, T, H, *]."""

from linear_attention.ops.kda.api import Backend
from linear_attention.ops.kda.api import kimi_delta_attention

__all__ = ["Backend", "kimi_delta_attention"]
