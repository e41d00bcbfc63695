"""linear_attention: Kimi Delta Attention and the DeepSeek-V4 CSA indexer in JAX/Haiku."""

from linear_attention import ops

__all__ = ["ops"]
