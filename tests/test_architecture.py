"""The layering of docs/design.md: imports point down only, and no cycles.

A static walk over every import statement of every module (function-level
imports included, since they hide cycles just as well), no import executed.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("configs", "experiments", "linear_attention", "benchmarks")
CLIS = ("run_experiment", "experiments.ablate", "experiments.sweep",
        "experiments.export_tpu")

# What each layer may import from the project (a prefix match on module
# names); third-party packages are free except where `FORBIDDEN` says.
ALLOWED = {
    "configs": ("configs",),
    "cli": ("configs", "experiments", "linear_attention"),
    "benchmarks": ("benchmarks", "configs", "experiments", "linear_attention"),
    "experiments": ("experiments", "linear_attention.modules",
                    "linear_attention.ops", "linear_attention.parallel"),
    "linear_attention.modules": ("linear_attention.modules",
                                 "linear_attention.ops"),
    "linear_attention.parallel": ("linear_attention.parallel",
                                  "linear_attention.ops"),
    "linear_attention.ops": ("linear_attention.ops",),
    "linear_attention": ("linear_attention.ops", "linear_attention.modules"),
    "linear_attention.testing": (),
}
# Configs are plain data: loading one imports no numerics.
FORBIDDEN = {"configs": ("jax", "haiku", "optax", "tokamax", "chex", "numpy")}


def _modules():
  """{module name: path} for every project module."""
  found = {"run_experiment": os.path.join(REPO, "run_experiment.py")}
  for package in PACKAGES:
    for root, _, files in os.walk(os.path.join(REPO, package)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(root, f)
          rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
          found[rel.removesuffix(".__init__")] = path
  return found


MODULES = _modules()


def _imports(name, path):
  """Project and third-party modules imported anywhere in the file."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = path.endswith("__init__.py")
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: resolve against this module's package
        parts = name.split(".")
        base = parts if is_package else parts[:-1]
        base = base[:len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
      else:
        prefix = node.module
      for a in node.names:
        full = f"{prefix}.{a.name}"
        out.add(full if full in MODULES else prefix)
  return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name):
  if name in CLIS:
    return "cli"
  for layer in sorted(ALLOWED, key=len, reverse=True):
    if name == layer or name.startswith(layer + "."):
      return layer
  return name.split(".")[0]


def _project(module):
  return module.split(".")[0] in PACKAGES + ("run_experiment",)


def test_the_walk_sees_the_project():
  assert "linear_attention.ops.kda.api" in MODULES
  assert "linear_attention.ops.kda.chunked" in GRAPH[
      "linear_attention.ops.kda.api"]
  assert "configs.common" in GRAPH["configs.mqar"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
  layer = _layer(name)
  allowed = ALLOWED.get(layer, ())
  bad = [m for m in sorted(GRAPH[name]) if _project(m) and not any(
      m == a or m.startswith(a + ".") for a in allowed)]
  assert not bad, f"{name} ({layer}) imports {bad}; it may import {allowed}."
  forbidden = [m for m in sorted(GRAPH[name]) if any(
      m == f or m.startswith(f + ".") for f in FORBIDDEN.get(layer, ()))]
  assert not forbidden, f"{name} imports {forbidden}: configs are plain data."
  if layer != "linear_attention.testing" and name.startswith(
      "linear_attention"):
    assert "linear_attention.testing" not in GRAPH[name], name


def test_no_import_cycles():
  edges = {n: {m for m in deps if m in GRAPH} for n, deps in GRAPH.items()}
  state, stack = {}, []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for m in sorted(edges[n]):
      if state.get(m) == "open":
        cycle = stack[stack.index(m):] + [m]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if m not in state:
        visit(m)
    stack.pop()
    state[n] = "done"

  for n in sorted(edges):
    if n not in state:
      visit(n)


def test_a_planted_upward_import_and_cycle_are_caught(tmp_path):
  """The checks above fail on the faults they exist for."""
  GRAPH["linear_attention.ops.kda.api"].add("experiments.train")
  try:
    with pytest.raises(AssertionError, match="imports"):
      test_imports_point_down("linear_attention.ops.kda.api")
    GRAPH["linear_attention.ops.kda.chunked"].add(
        "linear_attention.ops.kda.api")
    with pytest.raises(AssertionError, match="import cycle"):
      test_no_import_cycles()
  finally:
    GRAPH["linear_attention.ops.kda.api"].discard("experiments.train")
    GRAPH["linear_attention.ops.kda.chunked"].discard(
        "linear_attention.ops.kda.api")
