"""Test set-up shared by the whole suite.

Multi-device tests run on simulated CPU devices; the flag must be set before
jax is imported, so it lives here, the first file pytest loads.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
