"""Haiku modules (hk.Module) built on `linear_attention.ops`."""
