"""The one backend policy: which KDA implementation runs, and how.

`kimi_delta_attention` asks `resolve` once per call (the decode fallback
included), so a choice or a fallback is made in one place and logged once
(recurrentgemma resolves its `ScanType` the same way); code above the op
reads the answer through `linear_attention.ops.kda.api.resolved_backend`
(`tests/test_architecture.py` keeps `resolve` inside `ops/`). The platform
rules live here too: the chunked form's chunk size per platform.

* `Backend.AUTO` is `MOSAIC` on a TPU v6 or newer (the generations tokamax's
  Pallas kernel supports), `CHUNKED` everywhere else;
* a decode piece (the op decides which pieces are: those that continue a
  state where a chunked form would pad them) shorter than a chunk
  (`chunk_size()`: a decode step) runs the token recurrence, `REFERENCE`:
  one state update a token instead of a padded chunk (recurrentgemma runs
  its T == 1 step the same way); a longer one asked of `MOSAIC` whose T is
  not a multiple of 64 (the kernel's chunk) runs on `CHUNKED`. Both are
  logged once; the numbers are the same to float32 rounding;
* nothing else is switched: `MOSAIC` asked for off TPU raises (see
  `ops/kda/mosaic.py` for running it in interpret mode).
"""

import re

import jax

from linear_attention.ops import backend_enum

MOSAIC_MIN_TPU_GENERATION = 6
MOSAIC_CHUNK = 64
CPU_CHUNK = 16


class Backend(backend_enum.BackendEnum):
  """Every implementation of the KDA op; all return the same `(o, state)`."""

  REFERENCE = "reference"  # token-by-token lax.scan: the oracle
  CHUNKED = "chunked"  # chunked WY/UT form in XLA: CPU/GPU default
  MOSAIC = "mosaic"  # tokamax's Pallas TPU kernel
  AUTO = "auto"  # MOSAIC on TPU v6+, CHUNKED elsewhere


def tpu_generation(device_kind: str) -> int | None:
  """The TPU generation in a device kind, else None.

  "TPU v5p" -> 5, "TPU v6 lite" -> 6, "TPU7x" (Ironwood) -> 7.
  """
  match = re.match(r"TPU ?v?(\d+)", device_kind)
  return int(match.group(1)) if match else None


def _target_device():
  """The abstract device lowered for (`jax.sharding.use_abstract_mesh`)."""
  return jax.sharding.get_abstract_mesh().abstract_device


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
  """The platform being compiled for: "tpu", "gpu", "cpu".

  The abstract mesh's device's platform when lowering for another machine
  (`target_mesh`), else `jax.default_backend()`.
  """
  target = _target_device()
  return jax.default_backend() if target is None else target.platform


def _default_device_kind() -> str:
  target = _target_device()
  return jax.devices()[0].device_kind if target is None else target.device_kind


def resolve(backend: "str | Backend", *, decode_len: int | None = None,
            device_kind: str | None = None) -> Backend:
  """The backend that runs, for a requested one.

  Args:
    backend: "reference" | "chunked" | "mosaic" | "auto", or a `Backend`.
    decode_len: T of a piece that continues a state (decode), or None.
    device_kind: the device to decide for (default: the device of the
      abstract mesh in context when it names one, as
      `linear_attention.ops.kda.mosaic.lowering_mode` does, else the first
      device's `device_kind`, e.g. "TPU v6 lite", "cpu").

  Returns:
    A concrete `Backend` (never AUTO).

  Raises:
    ValueError: `backend` is not one of the names.
  """
  backend = Backend.parse(backend)
  if backend is Backend.AUTO:
    kind = _default_device_kind() if device_kind is None else device_kind
    generation = tpu_generation(kind)
    backend = (Backend.MOSAIC if generation is not None
               and generation >= MOSAIC_MIN_TPU_GENERATION
               else Backend.CHUNKED)
    backend_enum.log_once(("auto", kind), "KDA backend 'auto' on %s: %s.",
                          kind, backend.value)
  if (backend is not Backend.REFERENCE and decode_len is not None
      and decode_len < chunk_size()):
    backend_enum.log_once(
        ("decode", backend, decode_len), "KDA decode piece of T=%d (shorter"
        " than a chunk): the token recurrence ('reference') instead of %r.",
        decode_len, backend.value)
    backend = Backend.REFERENCE
  elif (backend is Backend.MOSAIC and decode_len is not None
        and decode_len % MOSAIC_CHUNK):
    backend_enum.log_once(
        ("decode", backend, decode_len), "KDA decode piece of T=%d is not a"
        " multiple of %d: running it on backend 'chunked' instead of"
        " 'mosaic'.", decode_len, MOSAIC_CHUNK)
    backend = Backend.CHUNKED
  backend_enum.log_once(("run", backend), "KDA backend: %s.", backend.value)
  return backend


def chunk_size(platform: str | None = None) -> int:
  """Tokens per chunk of the `chunked` backend: 16 on CPU, 64 elsewhere.

  On CPU a 16-token chunk is one block (no off-diagonal score products, a
  16 x 16 solve) and the smaller score and solve matmuls outweigh the longer
  chain of state updates (measured in docs/performance.md: ~15% less time
  than 64 at (1, 4096, 4, 64), lower_bound=-5; equal at -1). Accelerators
  keep 64: fewer, larger sequential steps.

  Args:
    platform: "cpu", "gpu", "tpu", ...; default the platform of the abstract
      mesh's device in context (lowering for another machine), else
      `jax.default_backend()`.
  """
  platform = target_platform() if platform is None else platform
  return CPU_CHUNK if platform == "cpu" else MOSAIC_CHUNK
