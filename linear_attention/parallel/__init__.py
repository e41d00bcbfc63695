"""Context and data parallelism over a jax.sharding.Mesh."""
