"""The mixer registry: config names -> mixers (`linear_attention.modules.mixer`).

A model's `mixer` is one name or a comma-separated pattern of names repeated
over its layers (e.g. "kda,kda,kda,attention", Kimi Linear's hybrid); each
name is looked up here. "none" is reserved: no mixer in that layer.

Adding a mixer is one file that defines its module and its `Mixer` entry,
and one line in `_BUILT_IN` below (or, outside this package, one
`register(entry)` call before the model is built; the test
`tests/experiments/test_mixers.py` registers a toy mixer that way and
trains it through the experiment config path).
"""

from linear_attention.modules import attention
from linear_attention.modules import kda
from linear_attention.modules import mixer

NONE = "none"  # a layer without a mixer (the MLP block only)

_BUILT_IN = (
    kda.MIXER,  # "kda": Kimi Delta Attention
    mixer.zeroed("kda_zeroed", kda.MIXER),  # the KDA layer, output times 0
    kda.GDN_MIXER,  # "gdn": Gated DeltaNet (the KDA layer, decay per head)
    attention.MIXER,  # "attention": softmax attention, RoPE or NoPE
)

_MIXERS: dict[str, mixer.Mixer] = {m.name: m for m in _BUILT_IN}


def register(entry: mixer.Mixer) -> mixer.Mixer:
  """Adds `entry` under its name; ValueError if the name is taken."""
  if entry.name in _MIXERS or entry.name == NONE:
    raise ValueError(f"mixer name {entry.name!r} is already registered.")
  _MIXERS[entry.name] = entry
  return entry


def unregister(name: str) -> None:
  """Removes a mixer added by `register` (built-in ones stay)."""
  if name in {m.name for m in _BUILT_IN}:
    raise ValueError(f"mixer {name!r} is built in; it cannot be removed.")
  _MIXERS.pop(name, None)


def names() -> tuple[str, ...]:
  """Every name a model's `mixer` may use, "none" included."""
  return tuple(_MIXERS) + (NONE,)


def get(name: str) -> mixer.Mixer | None:
  """The entry of `name` (None for "none"); ValueError for another name."""
  if name == NONE:
    return None
  if name not in _MIXERS:
    raise ValueError(f"mixer must be one of {list(names())}; got {name!r}.")
  return _MIXERS[name]
