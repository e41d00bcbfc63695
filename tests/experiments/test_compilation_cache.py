"""The entry points' persistent compilation cache writes, then is read."""

import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

_PROGRAM = """
import sys, jax, jax.numpy as jnp
from jax._src import monitoring
from experiments.training import compilation_cache
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None)
compilation_cache.enable(sys.argv[1])
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))))
print("hits", len(hits))
"""


def _run(cache_dir):
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  out = subprocess.run([sys.executable, "-c", _PROGRAM, cache_dir], cwd=root,
                       capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return int(out.stdout.split("hits")[-1])


class CompilationCacheTest(absltest.TestCase):

  def test_second_process_loads_what_the_first_compiled(self):
    cache_dir = os.path.join(tempfile.mkdtemp(), "cache")
    self.assertEqual(_run(cache_dir), 0)
    self.assertNotEmpty(os.listdir(cache_dir))
    self.assertGreater(_run(cache_dir), 0)

  def test_empty_directory_turns_it_off(self):
    from experiments.training import compilation_cache  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    before = jax.config.jax_compilation_cache_dir
    compilation_cache.enable("")
    self.assertEqual(jax.config.jax_compilation_cache_dir, before)


if __name__ == "__main__":
  absltest.main()
