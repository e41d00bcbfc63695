r"""Exports an experiment's training step for a TPU from any host: a dry run.

  python -m experiments.export_tpu --config=configs/mqar.py:tpu --chip=v6e
  python -m experiments.export_tpu --config=configs/mqar.py:smoke \
      --config.model.kda.backend=tokamax --chip=v6e

Builds the config's program (`experiments.training.program.build_program`:
model, loss, AdamW, the jitted train step) and, inside
`linear_attention.ops.kda.mosaic.lowering_mode(chip)`, exports the train step
with `jax.export.export(..., platforms=["tpu"])` on abstract inputs
(`jax.eval_shape` of the parameters and optimiser state, `ShapeDtypeStruct`s
of the batch): nothing is trained, nothing is compiled, no TPU is needed.
It prints the number of Mosaic kernels (`tpu_custom_call`s) in the module,
their names, the number per KDA layer and the serialized size. A mistake in
the command (a missing config file, an unknown field, a value out of range,
an unknown chip) exits 2 with one line on stderr (experiments/tools/cli.py;
`--verbose` adds the traceback); it exits 1 naming the problem when:

* the lowering fails (the exception, with a hint for the known causes);
* the model uses KDA but its backend does not resolve to "tokamax"
  (tokamax's Mosaic kernel) on `chip` (`--config.model.kda.backend=chunked`,
  or "auto" on a TPU before v6): a non-Mosaic path was traced;
* fewer Mosaic kernels than the KDA layers need were traced (a layer ran
  another backend: a "chunked fallback"), or no forward or no backward
  kernel;
* the backend cannot run on `chip` (its `supports_target`: tokamax's
  kernel needs TPU v6+), so the op refuses to trace it there.

How the checks are made, and why:

* Backend resolution. The report's backend is the op's answer for the kind
  JAX reports for that chip (`kda_api.resolved_backend(..., device_kind=)`,
  the op's registry), the same decision the
  layers make while traced inside `lowering_mode` (which names the chip as
  the target device). The
  train step has no decode pieces (no cache), so the other fallback of
  `resolve` (a decode piece whose T is not a multiple of 64) cannot arise in
  it.
* Fallback detection reads the exported module, the artefact a TPU would run,
  rather than spying on Python calls or on `resolve`'s log (which is logged
  once per process, and nothing records what was resolved). Kernels are
  counted per call site: JAX outlines a repeated computation into a private
  function called from every layer, so the text holds each kernel once
  however many layers call it; `count_kernels` walks the call graph from
  `main`. Each kernel is classed forward or backward from the tokamax op
  recorded in its metadata (`PallasMosaicTpuKimiDeltaAttention` /
  `...Vjp`). The kernels of one layer are measured by exporting the same
  config with one layer of its first mixer that runs the KDA op
  (`model.num_layers=1`, `model.mixer` that name; skipped when the config
  has one layer);
  the full step must hold one multiset per layer that runs the KDA op (a
  hybrid's attention layers run none). This does not depend on how many
  kernels tokamax's version splits the op into.
* Serialization: optax's state types are not registered for
  `Exported.serialize`, so the step is exported over its flattened leaves
  (the same computation; `in_tree` is then a flat tuple). Serializing needs
  the `flatbuffers` package; without it the size printed is that of the
  StableHLO bytecode (`mlir_module_serialized`), said so in the output.
* Devices: a config whose `mesh` asks for N = data x context devices is
  exported on a mesh of N host devices, with the batch sharded over it
  (`NamedSharding`s on the abstract inputs); on a CPU host the tool sets
  `XLA_FLAGS=--xla_force_host_platform_device_count=N` when JAX has not
  started yet (otherwise set it yourself). `jax.export` lowers such a
  sharded step for "tpu" from CPU devices (the module has N partitions).

How the TPU is targeted: `mosaic.lowering_mode(chip, mesh)` is JAX's
abstract-mesh cross-lowering (an `AbstractMesh` of the host mesh's axes whose
`abstract_device` is the chip) plus tokamax's `cross_compile` option; nothing
is patched. The parameter shapes come from a `reference` build of the same
model (`jax.eval_shape` runs outside the mode, where nothing may execute).

Known limits (the tool reports them; fixes belong in `linear_attention/`):

* tokamax with mesh.context > 1 needs K, V multiples of 128 (tokamax's
  context-parallel kernel).
* The tool is a check of the Mosaic path; it fails on the others (a
  `chunked` step lowers too, with the TPU's 64-token chunk).
* The export is a check, not an artefact to deploy: it is over the step's
  flattened leaves, and a sharded one records the host's abstract mesh.
"""

import collections
import dataclasses
import os
import re
import sys
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from ml_collections import config_flags

from configs import common as config_lib
from experiments import tasks as tasks_lib
from experiments.tools import cli
from experiments.training import model as model_lib
from experiments.training import program as program_lib
from linear_attention.ops.kda import api as kda_api
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import tokamax_kernel

TOKAMAX = tokamax_kernel.NAME  # the backend whose kernels this tool counts

FORWARD, BACKWARD, OTHER = "forward", "backward", "other"

# Known lowering failures: (text in the exception, what it means).
_HINTS = (
    ("manual_axis_type",
     "tokamax's Pallas kernels do not trace inside jax.shard_map with"
     " check_vma=True; the program passes check_vma=False to"
     " linear_attention.parallel.train.shard_loss_fn for tokamax, and a"
     " shard_map of your own around a tokamax call must too (a tracing"
     " error: a TPU fails the same way)."),
    ("Unsupported TPU device kind",
     "Pallas' Mosaic lowering read the TPU info of the host device: a"
     " Pallas call was traced outside mosaic.lowering_mode's abstract mesh"
     " (a jitted function traced before the export, or a shard_map over"
     " another mesh than the one passed to lowering_mode)."),
)


class ExportError(Exception):
  """The train step could not be built or lowered for the TPU."""


@dataclasses.dataclass(frozen=True)
class Report:
  """What `export_train_step` found; `problems(report)` judges it."""

  chip: str  # pltpu.ChipVersion name, e.g. "TPU_V6E"
  generation: int  # TPU generation of `chip`
  # The KDA op backend the layers ask for (None: no layer runs the op).
  requested_backend: str | None
  backend: str | None  # what it resolves to on `chip` (what was traced)
  num_kda_layers: int  # layers that run the KDA op (capability op_backend)
  num_devices: int  # devices the exported module runs on
  kernels: collections.Counter  # (direction, kernel name) -> call sites
  per_layer: collections.Counter | None  # the same for one KDA layer
  serialized_bytes: int
  serialized_how: str  # "Exported.serialize" or the fallback used
  exported: Any = dataclasses.field(repr=False, compare=False, default=None)

  @property
  def num_kernels(self) -> int:
    return sum(self.kernels.values())

  def count(self, direction: str) -> int:
    return sum(n for (d, _), n in self.kernels.items() if d == direction)


device_kind = mosaic.device_kind


def chip_generation(chip) -> int:
  return pltpu.get_tpu_info_for_chip(mosaic.chip_version(chip), 1).generation


def target_backend(config, chip) -> str | None:
  """The KDA backend a run of `config` uses on `chip`, or None (no KDA)."""
  requested = _requested_backend(config)
  if requested is None:
    return None
  return kda_api.resolved_backend(requested, device_kind=device_kind(chip))


def _requested_backend(config) -> str | None:
  """The KDA backend the model's layers ask for; None if none takes one."""
  backends = set(model_lib.op_backends(config.model))
  if len(backends) > 1:
    raise ExportError(f"the layers ask for several KDA backends"
                      f" {sorted(backends)}; the tool checks one.")
  return backends.pop() if backends else None


def _one_layer(config):
  """`config` with one layer, of its first mixer that runs the KDA op: the
  model whose kernels make up one layer's share of the train step."""
  (entry, *_) = model_lib.mixers_with(config.model, "op_backend")
  return config_lib.apply_diff(
      config, {"model.num_layers": 1, "model.mixer": entry.name})


_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([^\s(]+)\(",
                   re.M)
_CALL = re.compile(r"(?:^|[\s=])(?:func\.)?call @([^\s(]+)\(")
_KERNEL_NAME = re.compile(r'kernel_name = "([^"]+)"')
# tokamax records its op in each kernel's metadata (quotes escaped as \22).
_OP_TYPE = re.compile(r"PallasMosaicTpuKimiDeltaAttention(Vjp)?\\22")


def count_kernels(mlir_text: str, entry: str = "main") -> collections.Counter:
  """(direction, kernel name) -> number of `tpu_custom_call` call sites.

  Counted through the call graph from `entry`: a private function called
  from two layers contributes its kernels twice. The direction is
  "forward" / "backward" for tokamax's KDA op / its VJP, else "other"; the
  name is the Mosaic kernel's `kernel_name` ("?" when absent).
  """
  starts = list(_FUNC.finditer(mlir_text))
  own, calls = {}, {}
  for i, m in enumerate(starts):
    end = starts[i + 1].start() if i + 1 < len(starts) else len(mlir_text)
    kernels, callees = collections.Counter(), []
    for line in mlir_text[m.end():end].splitlines():
      if "@tpu_custom_call(" in line:
        name = _KERNEL_NAME.search(line)
        op = _OP_TYPE.search(line)
        direction = (OTHER if op is None else
                     BACKWARD if op.group(1) else FORWARD)
        kernels[(direction, name.group(1) if name else "?")] += 1
      else:
        callees.extend(_CALL.findall(line))
    own[m.group(1)], calls[m.group(1)] = kernels, callees
  if entry not in own:  # not the usual layout: count the text
    return collections.Counter(
        {(OTHER, "?"): mlir_text.count("@tpu_custom_call(")})
  totals: dict[str, collections.Counter] = {}

  def total(fn, seen=()):
    if fn not in totals:
      if fn in seen or fn not in own:  # recursion or an external symbol
        return collections.Counter()
      result = collections.Counter(own[fn])
      for callee in calls[fn]:
        result.update(total(callee, seen + (fn,)))
      totals[fn] = result
    return totals[fn]

  return total(entry)


def _ensure_host_devices(n: int) -> None:
  """Asks XLA for n host devices when JAX's backends have not started."""
  flag = "--xla_force_host_platform_device_count"
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if n <= 1 or flag in xla_flags:
    return
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  started = getattr(xla_bridge, "backends_are_initialized", lambda: True)()
  if not started:
    os.environ["XLA_FLAGS"] = f"{xla_flags} {flag}={n}".strip()


def _abstract_inputs(config, prog, mesh):
  """ShapeDtypeStructs of (params, opt_state, batch), sharded on `mesh`."""
  t = prog.task.seq_len
  # The parameters' shapes do not depend on the KDA backend: take them from a
  # `reference` build, which traces on any host (the tokamax kernel traces
  # only inside `lowering_mode`, which allows nothing but lowering).
  shapes = config.copy_and_resolve_references()
  for section in model_lib.sections_with(config.model, "op_backend"):
    shapes.model[section].backend = "reference"
  shape_prog = program_lib.build_program(shapes)
  params = jax.eval_shape(shape_prog.init, jax.random.key(config.seed),
                          jax.ShapeDtypeStruct((1, t), jnp.int32))
  opt_state = jax.eval_shape(prog.optimizer.init, params)
  # One example fixes the batch's dtypes; its shapes are [batch_size, T].
  example = prog.task.sample(tasks_lib.rng(config.seed, 0, 0), 1).as_dict()
  batch = {k: jax.ShapeDtypeStruct((config.train.batch_size, t), v.dtype)
           for k, v in example.items()}
  if mesh is not None:
    spec = jax.sharding.PartitionSpec(
        "data", "context" if config.mesh.context > 1 else None)
    shard = lambda s, p: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=jax.sharding.NamedSharding(mesh, p))
    replicated = jax.sharding.PartitionSpec()
    params = jax.tree.map(lambda s: shard(s, replicated), params)
    opt_state = jax.tree.map(lambda s: shard(s, replicated), opt_state)
    batch = jax.tree.map(lambda s: shard(s, spec), batch)
  return params, opt_state, batch


def _lower(config, chip):
  """(Exported, kernels) of `config`'s train step; ExportError if it fails."""
  try:
    program_lib.validate_config(config)
    _ensure_host_devices(config.mesh.data * config.mesh.context)
    prog = program_lib.build_program(config)
    mesh = program_lib.make_mesh(config)
    leaves, tree = jax.tree.flatten(_abstract_inputs(config, prog, mesh))

    def flat_step(*flat):
      return jax.tree.leaves(prog.train_step(*jax.tree.unflatten(tree, flat)))

    shardings = None if mesh is None else tuple(x.sharding for x in leaves)
    with mosaic.lowering_mode(chip, mesh):
      exported = jax.export.export(
          jax.jit(flat_step, in_shardings=shardings),
          platforms=["tpu"])(*leaves)
  except Exception as e:  # pylint: disable=broad-except
    message = f"{type(e).__name__}: {e}".strip()
    hints = [hint for key, hint in _HINTS if key in message]
    raise ExportError(
        "lowering the train step for the TPU failed: " + message
        + "".join(f"\nHint: {h}" for h in hints)) from e
  return exported, count_kernels(exported.mlir_module())


def _serialized_size(exported) -> tuple[int, str]:
  try:
    return len(exported.serialize()), "Exported.serialize"
  except ImportError:  # flatbuffers is not installed
    return (len(exported.mlir_module_serialized),
            "StableHLO bytecode only: `pip install flatbuffers` for"
            " Exported.serialize")


def export_train_step(config, chip) -> Report:
  """Exports `config`'s train step for `chip`; see the module docstring.

  Args:
    config: an experiment config (configs/*.py), not modified.
    chip: a TPU chip name ("v6e", "v5p", "7x", ...) or `pltpu.ChipVersion`.

  Returns:
    A `Report` (`problems(report)` lists what would stop a Mosaic run).

  Raises:
    ValueError: `chip` is not a TPU chip.
    ExportError: the config is invalid or the lowering failed.
  """
  chip_name = mosaic.chip_version(chip).name
  requested = _requested_backend(config)
  target = target_backend(config, chip)
  num_kda_layers = model_lib.count_layers_with(config.model, "op_backend")
  exported, kernels = _lower(config, chip)
  per_layer = None
  if target == TOKAMAX and config.model.num_layers == 1:
    per_layer = kernels
  elif target == TOKAMAX:
    _, per_layer = _lower(_one_layer(config), chip)
  size, how = _serialized_size(exported)
  return Report(chip=chip_name, generation=chip_generation(chip),
                requested_backend=requested, backend=target,
                num_kda_layers=num_kda_layers,
                num_devices=exported.nr_devices, kernels=kernels,
                per_layer=per_layer, serialized_bytes=size,
                serialized_how=how, exported=exported)


def problems(report: Report) -> list[str]:
  """What stops `report`'s config from running the Mosaic kernel; [] if OK."""
  if not report.num_kda_layers:
    return []
  chip = report.chip.removeprefix("TPU_").lower()
  if report.backend != TOKAMAX:
    why = ""
    if report.requested_backend == "auto":
      reason = kda_api.supports_target(TOKAMAX, device_kind(report.chip))
      why = f" ('auto' passes over {TOKAMAX!r} there: {reason})"
    return [
        f"the config's KDA backend {report.requested_backend!r} resolves to"
        f" {report.backend!r} on {chip}{why}, not {TOKAMAX!r}: a non-Mosaic"
        f" path was traced ({report.num_kernels} tpu_custom_call,"
        f" {report.num_kda_layers} KDA layers). Pass"
        f" --config.model.kda.backend={TOKAMAX} to check the Mosaic path."]
  found = []
  if report.num_kernels == 0:
    found.append(
        f"no Mosaic kernel (tpu_custom_call) in the module although"
        f" {report.num_kda_layers} KDA layers run backend {TOKAMAX!r}: they ran"
        " another path (a chunked fallback).")
  else:
    for direction in (FORWARD, BACKWARD):
      if report.count(direction) == 0:
        found.append(f"no {direction} Mosaic kernel in the train step.")
    if report.per_layer is not None:
      want = collections.Counter(
          {k: n * report.num_kda_layers for k, n in report.per_layer.items()})
      if report.kernels != want:
        found.append(
            f"{report.num_kernels} Mosaic kernels where"
            f" {report.num_kda_layers} KDA layers of"
            f" {sum(report.per_layer.values())} kernels each need"
            f" {sum(want.values())}: some layer ran another backend (a"
            " chunked fallback). Missing:"
            f" {dict(want - report.kernels)}; extra:"
            f" {dict(report.kernels - want)}.")
  old_chip = _old_chip_problem(report.chip)
  if old_chip:
    found.append(old_chip)
  return found


def _old_chip_problem(chip) -> str | None:
  """Why backend "tokamax" cannot run on `chip` (the backend's own answer,
  `supports_target`), or None if it can."""
  reason = kda_api.supports_target(TOKAMAX, device_kind(chip))
  if reason is None:
    return None
  return (f"backend {TOKAMAX!r} cannot run on {device_kind(chip)}: {reason}"
          " Use --config.model.kda.backend=chunked on this TPU.")


def format_report(report: Report) -> str:
  lines = [
      f"chip: {report.chip} (TPU generation {report.generation})",
      f"devices: {report.num_devices}",
  ]
  if report.num_kda_layers:
    lines.append(f"KDA layers: {report.num_kda_layers}, backend"
                 f" {report.requested_backend!r} -> {report.backend!r} on"
                 " this chip")
  else:
    lines.append("KDA: the model has no KDA layer")
  lines.append(
      f"Mosaic kernels (tpu_custom_call call sites): {report.num_kernels}"
      f" ({report.count(FORWARD)} forward, {report.count(BACKWARD)} backward"
      + (f", {report.count(OTHER)} other" if report.count(OTHER) else "")
      + ")")
  for (direction, name), n in sorted(report.kernels.items()):
    lines.append(f"  {n} x {name} ({direction})")
  if report.per_layer is not None and report.num_kda_layers:
    lines.append(f"Mosaic kernels per KDA layer: "
                 f"{sum(report.per_layer.values())}")
  lines.append(f"serialized module: {report.serialized_bytes} bytes"
               f" ({report.serialized_how})")
  return "\n".join(lines)


def parse_flags(argv: list[str]):
  """(config, chip) from a command line (argv[0] is the program)."""
  fv = flags.FlagValues()
  config = config_flags.DEFINE_config_file(
      "config", None,
      "Experiment config file, e.g. configs/mqar.py:tpu; `--config.x=y`"
      " overrides its fields.", flag_values=fv, lock_config=True,
      sys_argv=list(argv))
  chip = flags.DEFINE_string(
      "chip", "v6e",
      "TPU to lower for: v6e, v5p, 7x, ... (any pltpu.ChipVersion).",
      flag_values=fv)
  rest = fv(list(argv))
  cli.check_config_flags(fv)
  if len(rest) > 1:
    raise app.UsageError(f"Unexpected arguments: {rest[1:]}")
  if config.value is None:
    raise app.UsageError("--config is required.")
  return config.value, chip.value


def main(argv: list[str]) -> int:
  """Parses `argv`, exports, prints; returns the exit status (0: OK; 2: a
  mistake in the command, one line on stderr, experiments/tools/cli.py)."""
  err = lambda msg: print(f"export_tpu: error: {msg}", file=sys.stderr)
  try:
    config, chip = parse_flags(argv)
    mosaic.chip_version(chip)
    program_lib.validate_config(config)
  except Exception as e:  # pylint: disable=broad-except
    if not (cli.is_parse_mistake(e) or cli.is_mistake(e)):
      raise
    return cli.report(e, argv)
  try:
    report = export_train_step(config, chip)
  except (ExportError, ValueError) as e:  # ValueError: a bad backend name
    err(e)
    try:
      wants_tokamax = target_backend(config, chip) == TOKAMAX
    except ValueError:
      wants_tokamax = False
    old_chip = _old_chip_problem(chip) if wants_tokamax else None
    if old_chip:
      err(old_chip)
    return 1
  print(format_report(report))
  found = problems(report)
  for problem in found:
    err(problem)
  if found:
    return 1
  print("OK: the train step lowers for" f" {report.chip}"
        + (" with tokamax's Mosaic kernels in every KDA layer."
           if report.num_kda_layers else "."))
  return 0


def absl_flags_only(argv):
  """app.run's flags_parser: absl's own flags here, ours in `main`."""
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv):
    print(__doc__)
    sys.exit(0)
  return flags.FLAGS(argv, known_only=True)

