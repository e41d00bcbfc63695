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
        "experiments.export_tpu", "experiments.generate")

_EXPERIMENTS_BELOW = ("configs.validation", "experiments.tasks",
                      "linear_attention.modules", "linear_attention.ops",
                      "linear_attention.parallel")
# What each layer may import from the project (a prefix match on module
# names); third-party packages are free except where `FORBIDDEN` says.
ALLOWED = {
    "configs": ("configs",),
    "cli": ("configs", "experiments", "linear_attention"),
    "benchmarks": ("benchmarks", "configs", "experiments", "linear_attention"),
    # experiments/ by job, each folder over the ones before it: tasks (plain
    # NumPy), training (one run), then sweeps (many runs and their reports)
    # and tools (the command-line plumbing, generation, the TPU export) side
    # by side, neither importing the other. configs.validation: the config
    # checks, plain Python (no numerics); configs.common: `apply_diff`, for
    # the commands that derive configs from a base one.
    "experiments": (),  # the package itself
    "experiments.tasks": ("experiments.tasks",),
    "experiments.training": _EXPERIMENTS_BELOW + ("experiments.training",),
    "experiments.sweeps": _EXPERIMENTS_BELOW + (
        "configs.common", "experiments.training", "experiments.sweeps"),
    "experiments.tools": _EXPERIMENTS_BELOW + (
        "configs.common", "experiments.training", "experiments.tools"),
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
# Within a layer: modules that sit below the rest of it (nothing of the
# project, or only these), so that every other module may use them.
LEAVES = {
    "linear_attention.ops.checks": (),  # the op layer's argument checks
    "linear_attention.modules.mixer": (),  # the mixer contract
    "configs.validation": (),  # the config checks
}


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


def _source(name: str) -> str:
  with open(MODULES[name]) as f:
    return f.read()


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


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_leaves_import_nothing_of_the_layer_above_them(name):
  allowed = LEAVES[name]
  bad = [m for m in sorted(GRAPH[name]) if _project(m) and not any(
      m == a or m.startswith(a + ".") for a in allowed)]
  assert not bad, f"{name} imports {bad}; it may import only {allowed}."


def _backend_modules():
  """The modules registered as backends (they define `NAME`, `supports`)."""
  for name, path in sorted(MODULES.items()):
    with open(path) as f:
      tree = ast.parse(f.read())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}
    if {"NAME", "supports", "supports_target", "run"} <= defined:
      yield name


def test_backends_do_not_import_their_ops_entry_point():
  found = list(_backend_modules())
  assert {"linear_attention.ops.kda.tokamax_kernel",
          "linear_attention.ops.kda.reference",
          "linear_attention.ops.kda.chunked",
          "linear_attention.ops.csa.pallas"} <= set(found), found
  for name in found:
    api = name.rsplit(".", 1)[0] + ".api"
    assert api not in GRAPH[name], (
        f"{name} imports {api}: a backend is run by the op (its `run`), and"
        " composes other runners directly, never the public entry point.")


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
  planted = {"linear_attention.ops.kda.api": "experiments.training.train",
             "experiments.tasks.mqar": "experiments.training.model",
             "experiments.training.train": "experiments.sweeps.sweep_lib",
             "experiments.training.model": "experiments.tools.cli",
             "experiments.tools.generation": "experiments.sweeps.recall",
             "experiments.sweeps.sweep_lib": "experiments.tools.generation"}
  for name, upward in planted.items():
    GRAPH[name].add(upward)
  try:
    for name in planted:
      with pytest.raises(AssertionError, match="imports"):
        test_imports_point_down(name)
    GRAPH["linear_attention.ops.kda.chunked"].add(
        "linear_attention.ops.kda.api")
    with pytest.raises(AssertionError, match="import cycle"):
      test_no_import_cycles()
  finally:
    for name, upward in planted.items():
      GRAPH[name].discard(upward)
    GRAPH["linear_attention.ops.kda.chunked"].discard(
        "linear_attention.ops.kda.api")


# One owner for every decision: an op's backend is resolved by the op alone
# (its `api` and the registries of `linear_attention.ops.backends`).
OPS = "linear_attention.ops"
DECIDERS = ("resolve", "choose", "require")  # `backends.Registry`'s, api's


def _resolve_calls(source: str) -> list[int]:
  """Lines that make a backend decision: `<ops module or BACKENDS>.resolve`
  (or `choose`, `require`), or such a function imported from `ops`."""
  tree = ast.parse(source)
  imported = [(node.module or "", a) for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) for a in node.names] + [
                  ("", a) for node in ast.walk(tree)
                  if isinstance(node, ast.Import) for a in node.names]
  from_ops = lambda module, a: f"{module}.{a.name}".lstrip(".").startswith(
      OPS)
  aliases = {a.asname or a.name for module, a in imported
             if from_ops(module, a) and a.name in DECIDERS}
  modules = {a.asname or a.name.split(".")[-1] for module, a in imported
             if from_ops(module, a) and a.name.split(".")[-1] in (
                 "api", "backends")}
  lines = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in DECIDERS:
      owner = _dotted(f.value)
      if owner.split(".")[0] in modules or owner.endswith("BACKENDS"):
        lines.append(node.lineno)
    elif isinstance(f, ast.Name) and f.id in aliases:
      lines.append(node.lineno)
  return lines


@pytest.mark.parametrize("name", sorted(
    n for n in MODULES if not n.startswith("linear_attention.ops")))
def test_the_backend_is_resolved_in_ops_only(name):
  lines = _resolve_calls(_source(name))
  assert not lines, (
      f"{name} decides a backend at lines {lines}: the op decides it; ask"
      " `linear_attention.ops.kda.api.resolved_backend`.")


def test_a_planted_resolve_call_is_caught():
  assert _resolve_calls(
      "from linear_attention.ops.kda import api as kda_api\n"
      "kda_api.resolve('auto', call)\n"
      "kda_api.BACKENDS.choose('auto', target)\n") == [2, 3]
  assert _resolve_calls(
      "from linear_attention.ops.kda.api import resolve as r\nr('auto')\n"
  ) == [2]
  assert _resolve_calls("import re\nre.compile('x')\n"
                        "from linear_attention.ops.kda import api\n"
                        "api.resolved_backend('auto')\n"
                        "from linear_attention.ops.kda import precision\n"
                        "precision.resolve('auto', x)\n") == []


# Tests pass the library arguments; they never patch its module globals.
PATCHERS = {("mock", "patch"), ("patch", "object"), ("monkeypatch", "setattr"),
            ("mock.patch", "object"), ("monkeypatch", "setitem")}


def _dotted(node) -> str:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return f"{_dotted(node.value)}.{node.attr}"
  return ""


def _library_patches(source: str) -> list[int]:
  """Lines of a test that patch a project module (by object or by path)."""
  tree = ast.parse(source)
  project = {a.asname or a.name.split(".")[-1] for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom))
             for a in node.names
             if (getattr(node, "module", None) or a.name).split(".")[0]
             in PACKAGES}
  lines = []
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and node.args):
      continue
    func = _dotted(node.func)
    if not any(func == f"{a}.{b}" or func.endswith(f".{a}.{b}")
               for a, b in PATCHERS):
      continue
    target = node.args[0]
    if isinstance(target, ast.Name) and target.id in project:
      lines.append(node.lineno)
    elif (isinstance(target, ast.Constant) and isinstance(target.value, str)
          and target.value.split(".")[0] in PACKAGES):
      lines.append(node.lineno)
  return lines


def _test_files():
  for root, _, files in os.walk(os.path.join(REPO, "tests")):
    for f in sorted(files):
      if f.endswith(".py"):
        yield os.path.relpath(os.path.join(root, f), REPO)


@pytest.mark.parametrize("path", sorted(_test_files()))
def test_no_test_patches_a_library_global(path):
  with open(os.path.join(REPO, path)) as f:
    lines = _library_patches(f.read())
  assert not lines, (
      f"{path} patches a project module at lines {lines}: pass the value as"
      " an argument (e.g. the op's chunk_size) instead.")


def test_a_planted_patch_is_caught():
  planted = ("from unittest import mock\n"
             "from linear_attention.ops import backends\n"
             "mock.patch.object(backends, 'chunk_size', None)\n"
             "mock.patch('experiments.training.train.time')\n"
             "def t(monkeypatch):\n"
             "  monkeypatch.setattr(backends, 'resolve', None)\n")
  assert _library_patches(planted) == [3, 4, 6]
  assert _library_patches("from absl import logging\n"
                          "def t(monkeypatch):\n"
                          "  monkeypatch.setattr(logging, 'info', None)\n"
                          ) == []


# Library hygiene: `linear_attention` never prints, reads flags or the
# environment, or patches another package (experiments/ may: it is the
# program; e.g. experiments/training/interpret.py for Pallas interpret
# mode).
IMPURE_IMPORTS = ("unittest.mock", "mock", "absl.flags")
IMPURE_NAMES = ("os.environ", "os.getenv", "os.putenv", "print",
                "mock.patch", "setattr")


def _impurities(source: str) -> list[str]:
  """`line: what` for each impure import or use in a library module."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      names = [f"{node.module}.{a.name}" for a in node.names]
    else:
      names = []
    found += [f"{node.lineno}: import {n}" for n in names if any(
        n == m or n.startswith(m + ".") for m in IMPURE_IMPORTS)]
    if isinstance(node, (ast.Name, ast.Attribute)):
      name = _dotted(node)
      if name in IMPURE_NAMES:
        found.append(f"{node.lineno}: {name}")
  return sorted(found, key=lambda f: int(f.split(":")[0]))


@pytest.mark.parametrize("name", sorted(
    n for n in MODULES if n.startswith("linear_attention")))
def test_the_library_is_pure(name):
  found = _impurities(_source(name))
  assert not found, (f"{name} prints, reads flags or the environment, or"
                     f" patches: {found}. Log with absl.logging; take values"
                     " as arguments; leave switches to experiments/.")


def test_planted_impurities_are_caught():
  assert _impurities(
      "import os\nfrom unittest import mock\nfrom absl import flags\n"
      "x = os.environ.get('A')\nprint(x)\nsetattr(os, 'y', 1)\n") == [
          "2: import unittest.mock", "3: import absl.flags",
          "4: os.environ", "5: print", "6: setattr"]
  assert _impurities("from absl import logging\nimport os\n"
                     "logging.info(os.path.join('a', 'b'))\n") == []


# Code above the mixers asks a mixer's capabilities, never which one it is:
# no config section read by name, no comparison with a mixer's name.
MIXER_SECTIONS = ("kda", "attention")
MIXER_NAMES = ("kda", "kda_zeroed", "gdn", "attention")


def _mixer_questions(source: str) -> list[int]:
  """Lines that read a mixer's config section by name (`model.kda`) or
  compare a value with a mixer's name (`mixer == "kda"`)."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr in MIXER_SECTIONS:
      lines.append(node.lineno)
    elif isinstance(node, ast.Compare):
      sides = [node.left, *node.comparators]
      consts = [c for side in sides for c in (
          side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set))
          else [side]) if isinstance(c, ast.Constant)]
      if any(c.value in MIXER_NAMES for c in consts):
        lines.append(node.lineno)
  return sorted(set(lines))


@pytest.mark.parametrize("name", sorted(
    n for n in MODULES if _layer(n).split(".")[0] in ("experiments", "cli")))
def test_code_above_the_mixers_asks_capabilities(name):
  lines = _mixer_questions(_source(name))
  assert not lines, (
      f"{name} asks which mixer a layer is at lines {lines}; ask its"
      " capabilities (`experiments.training.model.sections_with`, ...).")


def test_a_planted_mixer_question_is_caught():
  assert _mixer_questions(
      "if config.model.kda.backend:\n  pass\n"
      "ok = mixer in ('kda', 'gdn')\n"
      "same = 'attention' == name\n"
      "fine = model[section].backend\n") == [1, 3, 4]

