"""The mixer contract: one call shape for every sequence mixer.

A mixer is a Haiku module (or any callable built inside `hk.transform`)
called as

    y, new_cache = mixer(x, *, segment_ids=None, cache=None)

* x [B, T, D] -> y [B, T, D] in x.dtype, causal;
* `segment_ids` [B, T] int: packed documents (1, 2, ..; 0 = padding, whose
  output is zero); no information crosses a document boundary;
* `cache`: None (training, or a prefill from nothing without a cache:
  `new_cache` is None), or the cache of the tokens before x (`new_cache`
  continues after x). A prefill of a prompt followed by one-token steps
  gives the outputs of one call over the whole sequence.

The `Mixer` entry of the registry (`linear_attention.modules.registry`)
says how to build one from its keyword arguments, how to make its empty
cache outside `hk.transform` (`init_cache(batch_size, max_len)`), how to
check its arguments, and what it can do (`Capabilities`): code above the
mixers asks a capability, never which mixer it is (recurrentgemma's blocks
and fla's layers share one call shape the same way).

A cache whose size bounds the positions it holds (attention's key/value
buffer) has a `max_positions` attribute; one without it holds any length
(a recurrent state).
"""

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple


class Capabilities(NamedTuple):
  """What a mixer can do, as code above it asks."""

  # Its decode cache is a state of one size at any length (no max_len).
  recurrent_state: bool
  # It takes a `backend` keyword: the KDA op's backend
  # (`linear_attention.ops.kda.api.BACKENDS`), resolved by the op.
  op_backend: bool
  # It runs with T split over a mesh axis inside `jax.shard_map`: it takes a
  # `context_axis` keyword (None: one device holds the sequence).
  context_parallel: bool


@dataclasses.dataclass(frozen=True)
class Mixer:
  """A registry entry: a config name and what it builds.

  Every callable takes the mixer's keyword arguments as one mapping (a
  config section spread once, plus `fixed`), so a misspelt keyword fails in
  the module's constructor.
  """

  name: str  # the config name (`model.mixer`, or an entry of a pattern)
  # The `config.model` section holding its keyword arguments (several
  # mixers may share one, e.g. "kda" and "gdn"); None: it takes none.
  section: str | None
  # (keywords, module name) -> the mixer, inside `hk.transform`.
  build: Callable[[Mapping[str, Any], str], Callable[..., Any]]
  # (batch_size, max_len, keywords) -> the all-zero cache, anywhere.
  init_cache: Callable[[int, int, Mapping[str, Any]], Any]
  # (keywords) -> None; ValueError naming the argument.
  validate: Callable[[Mapping[str, Any]], None]
  capabilities: Capabilities
  # Keywords set over the section's (e.g. Gated DeltaNet: decay="head").
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def keywords(self, sections: Mapping[str, Mapping[str, Any]]
               ) -> dict[str, Any]:
    """Its keyword arguments from the sections of a model config."""
    own = {} if self.section is None else dict(sections[self.section])
    return {**own, **self.fixed}


def zeroed(name: str, base: Mixer) -> Mixer:
  """`base` with its output times 0: the same parameters, compute and cache,
  and no information from other tokens (an ablation of the mixer)."""

  def build(keywords, module_name):
    layer = base.build(keywords, module_name)

    def call(x, *, segment_ids=None, cache=None):
      y, cache = layer(x, segment_ids=segment_ids, cache=cache)
      return y * 0.0, cache

    return call

  return dataclasses.replace(base, name=name, build=build)
