"""Mosaic (Pallas TPU) kernels off a TPU: lowering for a named chip, and the
interpret-mode switch.

Two modes let a Pallas TPU kernel (tokamax's KDA kernel, backend "tokamax";
our own in `pallas_tpu.py`) be traced where no TPU is attached:

* `lowering_mode(chip, mesh)`: `jax.export.export(f, platforms=["tpu"])`
  inside it lowers `f`'s Pallas calls to Mosaic for `chip`, by JAX's
  abstract-mesh cross-lowering (`jax.sharding.use_abstract_mesh` with an
  abstract TPU device, which Pallas reads the TPU's limits from) plus
  tokamax's `cross_compile` option. Nothing is patched. The backend policy
  (`linear_attention.ops.backends.target`) decides for that chip inside it.
* `interpreted()`: lets a backend that needs a TPU run in Pallas interpret
  mode on any device. The process-wide switches interpret mode also needs
  are the program's (`experiments.training.interpret.interpret_mode`), not the
  library's.

`off_tpu_mode()` says which mode this thread is in; a backend's
`supports` reads it through `backends.Target.off_tpu_mode`.
"""

import contextlib
import threading

import jax
from jax.experimental.pallas import tpu as pltpu

_state = threading.local()


def chip_version(chip) -> pltpu.ChipVersion:
  """A `pltpu.ChipVersion` from itself or a name ("v6e", "v5p", "7x", ...)."""
  if isinstance(chip, pltpu.ChipVersion):
    return chip
  name = str(chip).upper().removeprefix("TPU_").removeprefix("V")
  for member in pltpu.ChipVersion:
    if member.name.removeprefix("TPU_").removeprefix("V") == name:
      return member
  raise ValueError(
      f"chip must be a TPU generation, one of"
      f" {[m.name.removeprefix('TPU_').lower() for m in pltpu.ChipVersion]};"
      f" got {chip!r}.")


def off_tpu_mode() -> str | None:
  """This thread's off-TPU mode: "interpret", "lowering", or None."""
  return getattr(_state, "mode", None)


@contextlib.contextmanager
def interpreted():
  """Lets a backend that needs a TPU (KDA's "tokamax") run off TPU, in
  Pallas interpret mode.

  Interpret mode itself is two process-wide switches this library does not
  flip (it never sets the environment or replaces another package's
  functions): tokamax 0.0.17 reads `PALLAS_INTERPRET` from the environment,
  and sizes its kernel from `pltpu.get_tpu_info()` at trace time, which off
  TPU has no chip to describe.
  `experiments.training.interpret.interpret_mode(chip)` sets both for its
  duration and enters this context; so do the tests. Here only the op's own
  check is lifted (otherwise `NotImplementedError` off TPU), with tokamax's
  device check (`tokamax.config.cross_compile`).

  Yields:
    None.
  """
  import tokamax  # pylint: disable=g-import-not-at-top

  old_mode = off_tpu_mode()
  _state.mode = "interpret"
  try:
    with tokamax.config.cross_compile(True):
      yield
  finally:
    _state.mode = old_mode


# The device kind JAX reports for each chip (jax._src.tpu_info's table).
_DEVICE_KINDS = {
    "TPU_V2": "TPU v2", "TPU_V3": "TPU v3", "TPU_V4": "TPU v4",
    "TPU_V4I": "TPU v4 lite", "TPU_V5E": "TPU v5 lite", "TPU_V5P": "TPU v5",
    "TPU_V6E": "TPU v6 lite", "TPU_7": "TPU7", "TPU_7X": "TPU7x",
    "TPU_8I": "TPU8i", "TPU_8T": "TPU8t",
}
# Chips whose JAX device is a Megacore pair of TensorCores by default.
_MEGACORE = ("TPU_V4", "TPU_V5P")


def device_kind(chip) -> str:
  """The `device_kind` string JAX reports on `chip` (e.g. "TPU v6 lite")."""
  name = chip_version(chip).name
  return _DEVICE_KINDS.get(name, name.replace("_", " "))


def abstract_tpu(chip, num_cores: int | None = None):
  """A `jax.sharding.AbstractDevice` standing for one device of `chip`.

  Args:
    chip: a `pltpu.ChipVersion` or a name such as "v6e", "v5p", "7x".
    num_cores: TensorCores per JAX device; default 2 on Megacore chips (v4,
      v5p), else 1.
  """
  name = chip_version(chip).name
  if num_cores is None:
    num_cores = 2 if name in _MEGACORE else 1
  if num_cores not in (1, 2):
    raise ValueError(f"num_cores must be 1 or 2; got {num_cores!r}.")
  return jax.sharding.AbstractDevice(
      device_kind=device_kind(chip), num_cores=num_cores, platform="tpu")


def target_tpu():
  """The `AbstractDevice` of the TPU being lowered for, or None.

  Set by `lowering_mode` (or by any `jax.sharding.use_abstract_mesh` whose
  mesh names a TPU device): what Pallas' Mosaic lowering sizes for.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device if device is not None and device.platform == "tpu" else None


@contextlib.contextmanager
def lowering_mode(chip="v6e", mesh=None, *, num_cores=None):
  """Lowers Pallas TPU kernels (KDA's `backend="tokamax"`) for a TPU `chip`
  from any host.

  Inside it, `jax.export.export(f, platforms=["tpu"])` of a function that
  calls the op with `backend="tokamax"` traces tokamax's kernel sized for
  `chip` and lowers it to Mosaic (`tpu_custom_call`s in the module), with no
  TPU attached: check that a model lowers before paying for one. Nothing is
  patched: the context is JAX's own cross-lowering mechanism, an abstract
  mesh whose device is the target TPU (`jax.sharding.use_abstract_mesh`,
  which Pallas reads the TPU's limits from), plus tokamax's
  `tokamax.config.cross_compile` (which skips its check that the default
  device is a TPU).

  Only lowering works inside: running anything eagerly or calling a jitted
  function on concrete arrays fails (JAX needs the platforms that
  `jax.export` passes). Build inputs (`jax.eval_shape`, `ShapeDtypeStruct`s)
  outside the context, and export inside it.

  Args:
    chip: a `pltpu.ChipVersion` or a name such as "v6e", "v5p", "7x".
    mesh: the `jax.sharding.Mesh` the exported function's shardings and
      `shard_map`s use, if any (its axes become the abstract mesh's, on the
      TPU device); None for a single-device function.
    num_cores: TensorCores per device (see `abstract_tpu`).

  Yields:
    The abstract mesh in effect.
  """
  import tokamax  # pylint: disable=g-import-not-at-top

  device = abstract_tpu(chip, num_cores)
  if mesh is None:
    abstract = jax.sharding.AbstractMesh((1,), ("_tpu",),
                                         abstract_device=device)
  else:
    abstract = mesh.abstract_mesh.update(abstract_device=device)
  old_mode = off_tpu_mode()
  _state.mode = "lowering"
  try:
    with jax.sharding.use_abstract_mesh(abstract), \
         tokamax.config.cross_compile(True):
      yield abstract
  finally:
    _state.mode = old_mode


def off_tpu_reason(kernel: str, device_kind: str) -> str:
  """What a backend that needs a TPU says on another device."""
  return (f"it runs {kernel}, which needs a TPU; the default device is"
          f" {device_kind}. On CPU, call it inside"
          " `experiments.training.interpret.interpret_mode()` (Pallas interpret"
          " mode), export it for a TPU inside"
          " `linear_attention.ops.kda.mosaic.lowering_mode()`, or use"
          " backend='chunked'.")
