"""experiments/tools/export_tpu.py: a train step lowers for a TPU from CPU.

Tracing and lowering only (`jax.export` for platforms=["tpu"] inside
`mosaic.lowering_mode`); nothing is compiled or run. Each export takes a few
seconds on a CPU.

* the full MQAR step (2 KDA layers, loss, AdamW) with backend="tokamax" holds
  tokamax's forward and backward kernels for every layer, the same kernels
  a direct export of the op gives, and no chunked fallback; a layer forced
  onto "chunked" is caught;
* a sharded step (data x context mesh of CPU devices) exports for "tpu",
  and so do the Mosaic data-parallel and context-parallel steps and a
  bfloat16 Mosaic step (JAX's abstract-mesh cross-lowering: nothing in JAX
  or tokamax is patched);
* the CLI: exit 0 and the kernel count for tokamax, non-zero naming the
  problem for chunked and for a bad chip;
* the `tpu` config variants.
"""

import collections
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common as config_lib
from configs import delayed_copy
from configs import mqar
from experiments.tools import export_tpu
from experiments.training import program as program_lib
from linear_attention import ops
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import tokamax_kernel
from tests import devices as test_devices

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
FORWARD, BACKWARD = export_tpu.FORWARD, export_tpu.BACKWARD


def _config(variant="smoke", **diff):
  return config_lib.apply_diff(mqar.get_config(variant), diff)


def _op_kernels(b, t, h, kd, lower_bound):
  """Kernels of one direct `kimi_delta_attention` call and its VJP."""
  def loss(q, k, v, g, beta, a_log, dt_bias):
    o, _ = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_gate_in_kernel=True, use_qk_l2norm=True,
        backend="mosaic")
    return jnp.sum(o * o)

  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  args = (*(f32(b, t, h, kd),) * 4, f32(b, t, h), f32(h), f32(h * kd))
  with mosaic.lowering_mode("v6e"):
    exported = jax.export.export(
        jax.jit(jax.value_and_grad(loss, argnums=range(7))),
        platforms=["tpu"])(*args)
  return export_tpu.count_kernels(exported.mlir_module())


@pytest.mark.slow
def test_full_mqar_step_holds_mosaic_kernels_for_every_layer():
  config = _config("", **{"model.kda.backend": "tokamax"})
  report = export_tpu.export_train_step(config, "v6e")
  assert report.exported.platforms == ("tpu",)
  assert report.num_kda_layers == config.model.num_layers == 2
  assert report.backend == "tokamax" and report.num_devices == 1
  # Every layer: forward kernels and backward (VJP) kernels.
  assert report.count(FORWARD) >= 2 and report.count(BACKWARD) >= 2
  assert report.count(export_tpu.OTHER) == 0
  # One layer's kernels are exactly those of the op exported on its own at
  # the layer's shapes (independent of the tool's own calibration), and the
  # step holds them once per layer.
  b, t = config.train.batch_size, config.task.seq_len
  kda = config.model.kda
  direct = _op_kernels(b, t, kda.num_heads, kda.head_dim, kda.lower_bound)
  assert report.per_layer == direct
  assert report.kernels == collections.Counter(
      {k: 2 * n for k, n in direct.items()})
  assert export_tpu.problems(report) == []
  assert report.serialized_bytes > 0


def test_problems_flag_missing_kernels_and_old_chips():
  per_layer = collections.Counter({(FORWARD, "f"): 2, (BACKWARD, "b"): 3})
  report = export_tpu.Report(
      chip="TPU_V6E", generation=6, requested_backend="mosaic",
      backend="tokamax", num_kda_layers=2, num_devices=1,
      kernels=per_layer + per_layer, per_layer=per_layer,
      serialized_bytes=1, serialized_how="test")
  assert export_tpu.problems(report) == []
  one_layer = dataclasses.replace(report, kernels=per_layer)
  assert "chunked fallback" in export_tpu.problems(one_layer)[0]
  none = dataclasses.replace(report, kernels=collections.Counter())
  assert "no Mosaic kernel" in export_tpu.problems(none)[0]
  no_bwd = dataclasses.replace(
      report, per_layer=None,
      kernels=collections.Counter({(FORWARD, "f"): 4}))
  assert export_tpu.problems(no_bwd) == [
      "no backward Mosaic kernel in the train step."]
  v5p = dataclasses.replace(report, chip="TPU_V5P", generation=5)
  assert "v6+ only" in export_tpu.problems(v5p)[0]
  auto = dataclasses.replace(report, chip="TPU_V5P", generation=5,
                             requested_backend="auto", backend="chunked")
  (problem,) = export_tpu.problems(auto)
  # The backend's own reason (its supports_target), not a rule restated.
  assert "'auto' passes over 'tokamax' there" in problem
  assert "v6+ only" in problem and "not 'tokamax'" in problem
  no_kda = dataclasses.replace(report, num_kda_layers=0, backend=None,
                               kernels=collections.Counter())
  assert export_tpu.problems(no_kda) == []


def test_kernels_are_counted_through_the_call_graph():
  def kernel(name, op):  # one line of a printed module, as JAX prints it
    return ("    %0 = stablehlo.custom_call @tpu_custom_call(%arg0)"
            ' {backend_config = "", kernel_name = "' + name + '",'
            ' mhlo.frontend_attributes = {xla_metadata_payload = "tokamax:'
            '{\\22__type\\22:\\22tokamax.' + op + '\\22}"}} : () -> ()')

  text = "\n".join([
      "module @jit_f {",
      "  func.func public @main(%arg0: tensor<f32>) {",
      "    %0 = call @layer(%arg0) : (tensor<f32>) -> tensor<f32>",
      "    %1 = func.call @layer(%0) : (tensor<f32>) -> tensor<f32>",
      kernel("other_kernel", "SomethingElse"),
      "  }",
      "  func.func private @layer(%arg0: tensor<f32>) {",
      kernel("fwd_kernel", "PallasMosaicTpuKimiDeltaAttention"),
      kernel("bwd_kernel", "PallasMosaicTpuKimiDeltaAttentionVjp"),
      "  }",
      "  func.func private @unused(%arg0: tensor<f32>) {",
      kernel("dead_kernel", "PallasMosaicTpuKimiDeltaAttention"),
      "  }",
      "}"])
  assert export_tpu.count_kernels(text) == collections.Counter({
      (FORWARD, "fwd_kernel"): 2, (BACKWARD, "bwd_kernel"): 2,
      (export_tpu.OTHER, "other_kernel"): 1})


def test_serialized_size_without_flatbuffers():
  class Exported:
    mlir_module_serialized = b"12345"

    def serialize(self):
      raise ImportError("Please install 'flatbuffers'")

  # pylint: disable-next=protected-access
  size, how = export_tpu._serialized_size(Exported())
  assert size == 5 and "flatbuffers" in how


@pytest.mark.slow
def test_sharded_step_exports_for_tpu_from_cpu_devices():
  # The XLA path on a 2 x 2 (data x context) mesh: the module is lowered for
  # 4 TPU devices with the batch sharded over both axes. The mesh is of the
  # default backend's devices: simulated CPU devices (tests/conftest.py);
  # skipped on a single chip.
  test_devices.devices(4)
  config = _config(**{"mesh.data": 2, "mesh.context": 2,
                      "task.seq_len": 128})
  report = export_tpu.export_train_step(config, "v6e")
  assert report.num_devices == 4
  assert "mhlo.num_partitions = 4" in report.exported.mlir_module()
  batch_specs = [s.spec for s in report.exported.in_shardings_jax(
      program_lib.make_mesh(config))[-3:]]
  assert batch_specs == [jax.sharding.PartitionSpec("data", "context")] * 3
  (problem,) = export_tpu.problems(report)  # chunked: not the Mosaic path
  assert "'chunked'" in problem


def test_data_parallel_mosaic_step_exports():
  # tokamax's pallas_calls do not trace under shard_map's check_vma=True;
  # the program turns it off for mosaic (shard_loss_fn(check_vma=False)).
  test_devices.devices(2)  # a mesh of the default backend's devices
  report = export_tpu.export_train_step(
      _config(**{"model.kda.backend": "mosaic", "mesh.data": 2}), "v6e")
  assert export_tpu.problems(report) == []


def test_auto_backend_resolves_to_mosaic_for_the_chip_while_traced():
  # The layers resolve "auto" themselves inside lowering_mode (the target
  # device is the chip's, not this CPU's).
  for mesh_data in (1, 2):
    if mesh_data > 1:  # a mesh of the default backend's devices
      test_devices.devices(mesh_data)
    report = export_tpu.export_train_step(
        _config(**{"model.kda.backend": "auto", "mesh.data": mesh_data}),
        "v6e")
    assert report.requested_backend == "auto" and report.backend == "tokamax"
    assert export_tpu.problems(report) == []
    assert report.count(FORWARD) >= 1 and report.count(BACKWARD) >= 1


def test_bfloat16_mosaic_step_exports():
  report = export_tpu.export_train_step(
      _config(**{"model.kda.backend": "mosaic",
                 "model.compute_dtype": "bfloat16"}), "v6e")
  assert export_tpu.problems(report) == []
  # The kernels run on bfloat16 operands (tokamax's bf16 kernel variant).
  kernels = [line for line in report.exported.mlir_module().splitlines()
             if "@tpu_custom_call(" in line]
  assert kernels and all("bf16" in line for line in kernels)


def test_context_parallel_mosaic_step_exports():
  # tokamax's context-parallel kernel (K, V multiples of 128; the model's
  # unpacked rows reach it as one segment per row).
  test_devices.devices(2)  # a mesh of the default backend's devices
  report = export_tpu.export_train_step(
      _config(**{"model.kda.backend": "mosaic", "mesh.context": 2,
                 "task.seq_len": 128, "model.kda.head_dim": 128}), "v6e")
  assert export_tpu.problems(report) == []
  assert report.count(export_tpu.FORWARD) >= 2


def _main(capsys, *args, config="mqar.py:smoke"):
  status = export_tpu.main(
      ["export_tpu", f"--config={REPO}/configs/{config}", *args])
  out, err = capsys.readouterr()
  return status, out, err


def test_cli_tokamax_smoke_exits_0_and_prints_the_kernels(capsys):
  status, out, err = _main(capsys, "--config.model.kda.backend=tokamax",
                           "--chip=v6e")
  assert status == 0, err
  n = int(re.search(r"Mosaic kernels \(tpu_custom_call call sites\): (\d+)",
                    out).group(1))
  assert n >= 2
  assert "_kernel (forward)" in out and "_kernel (backward)" in out
  assert re.search(r"serialized module: \d+ bytes", out)
  assert out.rstrip().splitlines()[-1].startswith("OK:")


def test_cli_hybrid_counts_only_the_layers_that_run_the_kda_op(
    capsys, tmp_path):
  # configs/text.py:smoke is the hybrid "kda,attention": one of its two
  # layers runs the KDA op. One layer's kernels are measured on a one-layer
  # "kda" model (not on the config with num_layers=1, which the pattern of
  # two does not divide), and the step holds them once.
  corpus = tmp_path / "corpus"
  rng = np.random.default_rng(0)
  for i in range(300):  # a small stand-in for the standard library
    (corpus / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
    (corpus / f"pkg{i % 4}" / f"m{i}.py").write_bytes(
        bytes(rng.integers(32, 127, 200).astype(np.uint8)))
  status, out, err = _main(
      capsys, "--config.model.kda.backend=mosaic", "--chip=v6e",
      f"--config.task.source_dir={corpus}",
      f"--config.task.cache_dir={tmp_path / 'cache'}",
      config="text.py:smoke")
  assert status == 0, err
  assert "KDA layers: 1, backend 'mosaic' -> 'tokamax'" in out
  total = int(re.search(r"call sites\): (\d+)", out).group(1))
  per_layer = int(re.search(r"per KDA layer: (\d+)", out).group(1))
  assert total == per_layer >= 2


def test_cli_chunked_exits_nonzero_naming_the_backend(capsys):
  status, out, err = _main(capsys, "--config.model.kda.backend=chunked",
                           "--chip=v6e")
  assert status == 1
  assert "'chunked'" in err and "not 'tokamax'" in err
  assert "Mosaic kernels (tpu_custom_call call sites): 0" in out


def test_cli_bad_chip_exits_nonzero_naming_it(capsys):
  status, out, err = _main(capsys, "--config.model.kda.backend=mosaic",
                           "--chip=v9z")
  assert status == 2 and "'v9z'" in err and "chip must be" in err
  assert not out


@pytest.mark.parametrize("module", [mqar, delayed_copy])
def test_tpu_variants_fit_their_mesh_and_the_kernel(module):
  config = module.get_config("tpu")
  program_lib.validate_config(config)
  data = config.mesh.data * config.mesh.context
  assert config.train.batch_size % data == 0
  assert config.train.eval_batch_size % data == 0
  task = program_lib.tasks_lib.make_task(**config.task.to_dict())
  if config.model.kda.backend == "tokamax":
    assert task.seq_len % tokamax_kernel.CHUNK == 0
  with pytest.raises(ValueError, match="'tpu'"):
    module.get_config("tpuu")
