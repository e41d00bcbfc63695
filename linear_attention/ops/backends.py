"""Backend registries and the one resolver: which implementation of an op runs.

Each backend of an op is one module with

* `NAME`: the name a config or caller asks for (e.g. "chunked");
* `supports_target(target) -> None | reason`: whether it runs on the device
  compiled for at all (a `Target`: platform, device kind, off-TPU mode);
* `supports(call) -> None | reason`: whether it takes this call (dtypes,
  shapes, options, and the target, `call.target`); the reason is a sentence
  that names the limit;
* `run(call)`: the op's result for a call it supports;
* optional capabilities, read through the registry: `CHECK_VMA` (False: it
  does not trace inside `jax.shard_map` with `check_vma=True`, as Pallas
  kernels of tokamax do) and `NEEDS_TPU` (True: off a TPU it runs only in
  Pallas interpret mode), and `auto_declines(target, call) -> None |
  reason`: why "auto" passes over a backend that could run the call (it
  is not measured faster there; `call` None: any call on the target).

A `Registry` names an op's backends, accepts old names as aliases, and holds
the per-platform preference list that "auto" walks. `Registry.resolve` is
the one decision (recurrentgemma resolves its `ScanType` once the same way;
fla's per-op registry lets each backend say why it cannot):

* an explicit name runs that backend, or raises `NotImplementedError` with
  the backend's own reason;
* "auto" runs the first backend of the target platform's list that takes
  the call and does not decline it (`auto_declines`), logged once; when
  none does, `NotImplementedError` lists every backend's reason.

Nothing else switches a backend (an op may add a rule of its own, such as
KDA's decode pieces, in its `api.py`). `tests/test_architecture.py` keeps
the calls of `resolve` inside `ops/`; code above asks the op's `api`.

The target: the host's first device, or, while lowering for another machine
(`jax.sharding.use_abstract_mesh` with an abstract device, as
`linear_attention.ops.kda.mosaic.lowering_mode` sets), that device. Every
platform rule here (`target`, `target_platform`, `chunk_size`,
`target_mesh`) decides for it.
"""

import re
from types import ModuleType
from typing import Any, Mapping, NamedTuple

from absl import logging
import jax

AUTO = "auto"
CPU_CHUNK = 16
ACCELERATOR_CHUNK = 64

_logged: set[tuple] = set()


def log_once(key: tuple, msg: str, *args) -> None:
  """`logging.info(msg, *args)` the first time `key` is seen in a process."""
  if key not in _logged:
    _logged.add(key)
    logging.info(msg, *args)


def tpu_generation(device_kind: str) -> int | None:
  """The TPU generation in a device kind, else None.

  "TPU v5p" -> 5, "TPU v6 lite" -> 6, "TPU7x" (Ironwood) -> 7.
  """
  match = re.match(r"TPU ?v?(\d+)", device_kind)
  return int(match.group(1)) if match else None


class Target(NamedTuple):
  """The device a call is compiled for."""

  platform: str  # "tpu", "gpu" or "cpu"
  device_kind: str  # as JAX reports it, e.g. "TPU v6 lite", "cpu"
  # "interpret" (Pallas interpret mode), "lowering" (exporting for a TPU),
  # or None: the modes of `linear_attention.ops.kda.mosaic`.
  off_tpu_mode: str | None = None

  @property
  def tpu_generation(self) -> int | None:
    """The TPU generation, or None off TPU (or for an unreadable kind)."""
    return tpu_generation(self.device_kind) if self.platform == "tpu" else None


def _target_device():
  """The abstract device lowered for (`jax.sharding.use_abstract_mesh`)."""
  return jax.sharding.get_abstract_mesh().abstract_device


def target(device_kind: str | None = None,
           off_tpu_mode: str | None = None) -> Target:
  """The `Target` of a call made here, or of a device named by its kind.

  Args:
    device_kind: a device kind ("TPU v6 lite", "cpu", a GPU's name) to
      decide for instead of the device in context; its platform is read
      from it ("TPU ..." -> "tpu", "cpu" -> "cpu", anything else "gpu").
    off_tpu_mode: see `Target`.
  """
  if device_kind is None:
    device = _target_device() or jax.devices()[0]
    return Target(device.platform, device.device_kind, off_tpu_mode)
  platform = ("tpu" if tpu_generation(device_kind) is not None else
              "cpu" if device_kind.lower() == "cpu" else "gpu")
  return Target(platform, device_kind, off_tpu_mode)


def target_mesh(mesh):
  """`mesh`, or the abstract mesh in context that stands for it elsewhere.

  When lowering for another machine (`jax.sharding.use_abstract_mesh` with
  an abstract device, as `linear_attention.ops.kda.mosaic.lowering_mode`
  sets), a `jax.shard_map` must run on the context's abstract mesh, not on
  the host's concrete `mesh` of the same shape (JAX checks they match, and
  the abstract one carries the target device). Library code passes its
  meshes through here.
  """
  context = jax.sharding.get_abstract_mesh()
  if (mesh is not None and not context.empty
      and context.abstract_device is not None
      and context.shape_tuple == mesh.shape_tuple):
    return context
  return mesh


def target_platform() -> str:
  """The platform being compiled for: "tpu", "gpu", "cpu" (see `target`)."""
  device = _target_device()
  return jax.default_backend() if device is None else device.platform


def chunk_size(platform: str | None = None) -> int:
  """Tokens per chunk of KDA's `chunked` backend: 16 on CPU, 64 elsewhere.

  On CPU a 16-token chunk is one block (no off-diagonal score products, a
  16 x 16 solve) and the smaller score and solve matmuls outweigh the longer
  chain of state updates (measured in docs/performance.md: ~15% less time
  than 64 at (1, 4096, 4, 64), lower_bound=-5; equal at -1). Accelerators
  keep 64: fewer, larger sequential steps. A decode piece shorter than this
  runs the token recurrence (`linear_attention.ops.kda.api`).

  Args:
    platform: "cpu", "gpu", "tpu", ...; default `target_platform()`.
  """
  platform = target_platform() if platform is None else platform
  return CPU_CHUNK if platform == "cpu" else ACCELERATOR_CHUNK


def no_limit(_) -> None:
  """`supports_target` and `supports` of a backend that takes every call
  the op accepts, on every device (plain XLA)."""
  return None


class Registry:
  """An op's backends by name, their aliases and the preference for "auto".

  Args:
    op: the op's name, for messages and logs ("KDA").
    backends: the backend modules (see the module docstring), in the order
      messages list them; each is registered under its `NAME`.
    aliases: {old name: name}: accepted wherever a name is, e.g. names
      written into saved configs before a rename.
    preference: {platform: names in order} that "auto" walks, with a
      "default" entry for platforms not listed; None: the op has no "auto".
  """

  def __init__(self, op: str, backends: tuple[ModuleType, ...], *,
               aliases: Mapping[str, str] | None = None,
               preference: Mapping[str, tuple[str, ...]] | None = None):
    self.op = op
    self.backends = {b.NAME: b for b in backends}
    self.aliases = dict(aliases or {})
    self.preference = None if preference is None else dict(preference)
    for name in list(self.aliases.values()) + [
        n for names in (self.preference or {}).values() for n in names]:
      if name not in self.backends:
        raise ValueError(f"{op} registry: {name!r} is not a backend.")

  def names(self) -> tuple[str, ...]:
    """The names a caller may ask for (aliases not included)."""
    return tuple(self.backends) + ((AUTO,) if self.preference else ())

  def parse(self, name: Any) -> str:
    """The canonical name of `name` (an alias gives its new name).

    Raises:
      ValueError: not a name, alias or (when the op has one) "auto".
    """
    if isinstance(name, str):
      if name in self.backends or (name == AUTO and self.preference):
        return name
      if name in self.aliases:
        return self.aliases[name]
    aliases = "".join(f"; {old!r} is accepted for {new!r}"
                      for old, new in self.aliases.items())
    raise ValueError(f"backend must be one of {list(self.names())}{aliases};"
                     f" got {name!r}.")

  def candidates(self, name: str, platform: str | None = None
                 ) -> tuple[str, ...]:
    """The backends `name` may run: itself, or "auto"'s list on `platform`
    (None: the union of every platform's list)."""
    name = self.parse(name)
    if name != AUTO:
      return (name,)
    if platform is not None:
      return self.preference.get(platform, self.preference["default"])
    return tuple(dict.fromkeys(n for names in self.preference.values()
                               for n in names))

  def capability(self, name: str, attribute: str, default: bool) -> bool:
    """Whether every backend `name` may run on any platform has `attribute`
    true (a module without it counts as `default`)."""
    return all(getattr(self.backends[n], attribute, default)
               for n in self.candidates(name))

  def supports_target(self, name: str, target_: Target) -> str | None:
    """The backend's reason it cannot run on `target_`, or None."""
    return self.backends[self.parse(name)].supports_target(target_)

  def choose(self, name: str, target_: Target, call=None) -> str:
    """The backend `name` stands for: itself, or for "auto" the first of the
    target platform's list that takes `call` and does not decline it
    (without a call: that runs on the target and does not decline it).
    NotImplementedError with every reason when none does."""
    name = self.parse(name)
    if name != AUTO:
      return name
    reasons = []
    for candidate in self.candidates(name, target_.platform):
      backend = self.backends[candidate]
      reason = (backend.supports_target(target_) if call is None
                else backend.supports(call))
      if reason is None:
        reason = getattr(backend, "auto_declines", lambda *_: None)(
            target_, call)
      if reason is None:
        log_once((self.op, AUTO, target_.device_kind, candidate),
                 "%s backend 'auto' on %s: %s.", self.op,
                 target_.device_kind, candidate)
        return candidate
      reasons.append(f"{candidate!r}: {reason}")
    raise NotImplementedError(
        f"{self.op} backend 'auto' on {target_.device_kind}: no backend"
        " takes this call. " + " ".join(reasons))

  def require(self, name: str, call) -> ModuleType:
    """The module of backend `name` (not "auto") if it takes `call`, else
    NotImplementedError with its reason."""
    backend = self.backends[self.parse(name)]
    reason = backend.supports(call)
    if reason is not None:
      raise NotImplementedError(
          f"{self.op} backend {backend.NAME!r} cannot run this call: {reason}")
    log_once((self.op, "run", backend.NAME), "%s backend: %s.", self.op,
             backend.NAME)
    return backend

  def resolve(self, name: str, call) -> ModuleType:
    """`require(choose(name, call.target, call), call)`: the backend module
    that runs `call`."""
    return self.require(self.choose(name, call.target, call), call)
