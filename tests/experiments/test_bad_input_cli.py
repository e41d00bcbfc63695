"""Bad input on every command line: one line on stderr and exit status 2.

Each class of mistake a user can type (a missing config file, an unknown
field, a wrong type, a value out of range, a workdir that is a file, a
damaged checkpoint, a config of the wrong kind, a cosine run extended, an
empty selection) is tried on every entry point that takes it, as the user
runs it: from the repository root, each command in a process of its own,
run as `python <script>` or `python -m <module>` would run it. The
expectation of each case is written here, not read from the code: exit
status 2, stderr's last line `<program>: error: ...` naming the flag, field
or file, no traceback (and, for a mistake in the flags, nothing else on
stderr); with --verbose the traceback comes first. One test checks every
answer.

A fresh interpreter spends ~3 s importing JAX and the other packages (and
~1 s tearing them down at exit), which would be most of the test's time; so
each command's process is forked from one (a fork server, `_serve`) that
imported those packages once and started nothing of JAX's (no backend, none
of its threads). The child runs the command's own code, from its imports of
this repository on, with its own sys.argv, sys.path[0], `__main__`, stdout
and stderr files, and ends as the interpreter ends a program: its exit
status, traceback, threads, atexit handlers and last garbage collection,
but not the teardown of every module (see `_serve`).
"""

import concurrent.futures
import dataclasses
import glob
import inspect
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from configs import common as config_lib
from configs import mqar
from experiments.training import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
RUN = "run_experiment.py"
ABLATE, SWEEP, GENERATE, EXPORT = ("experiments.ablate", "experiments.sweep",
                                   "experiments.generate",
                                   "experiments.export_tpu")
BENCH = "benchmarks.kda_error_vs_length"
SMOKE = "--config=configs/mqar.py:smoke"
SWEEP_SMOKE = "--config=configs/sweeps/kimi_synthetic.py:smoke"


@dataclasses.dataclass(frozen=True)
class Case:
  program: str  # a script path or a module for -m
  args: tuple[str, ...]
  names: tuple[str, ...]  # what the last line must say (flag, field, file)
  parse: bool = False  # a mistake in the flags: stderr is that line only
  refused_first: bool = True  # refused before the run starts: no config log
  prefix: str | None = None  # the line's program, if not `program`'s
  # A damaged checkpoint: TensorStore's reads left in flight by orbax's
  # failed restore print "Event loop is closed" tracebacks of their own
  # (experiments/training/checkpoints.py `_read`); none of ours comes before the
  # line.
  dependency_noise: bool = False

  @property
  def program_name(self):
    if self.prefix:
      return self.prefix
    return (os.path.basename(self.program) if self.program.endswith(".py")
            else self.program)


def _cases(tmp):
  """name -> Case; `tmp` holds the files the cases point at."""
  afile = os.path.join(tmp, "a_file")
  out = os.path.join(tmp, "out")
  stopped, damaged, ruined = (os.path.join(tmp, d)
                              for d in ("stopped", "damaged", "ruined"))
  missing = ("--config=configs/nope.py", "configs/nope.py")
  cases = {}

  def add(name, program, *args, names, parse=False, refused_first=True,
          prefix=None, dependency_noise=False):
    cases[name] = Case(program, tuple(args), tuple(names), parse,
                       refused_first, prefix, dependency_noise)

  # A config file that is not there, on every command that takes one. (The
  # flags of every command parse in one place, experiments/tools/cli.py: the
  # other classes try each command where it has code of its own.)
  for program in (RUN, SWEEP):
    add(f"missing_config/{program}", program, missing[0], f"--workdir={out}",
        names=missing, parse=True)
  add(f"missing_config/{EXPORT}", EXPORT, missing[0], names=missing,
      parse=True)
  # A field the config does not have: ml_collections' suggestion.
  typo = ("--config.train.num_step", "'num_steps'")
  add(f"unknown_field/{RUN}", RUN, SMOKE, f"--workdir={out}",
      "--config.train.num_step=2", names=typo, parse=True)
  add(f"unknown_field/{EXPORT}", EXPORT, SMOKE, "--config.train.num_step=2",
      names=typo, parse=True)
  # A value of the wrong type.
  wrong_type = ("--config.train.num_steps=abc", "must be an int")
  add(f"wrong_type/{RUN}", RUN, SMOKE, f"--workdir={out}", wrong_type[0],
      names=wrong_type, parse=True)
  add(f"wrong_type/{ABLATE}/seeds", ABLATE, SMOKE, f"--workdir={out}",
      "--seeds=0,one", names=("--seeds=0,one", "an int"))
  # A value out of range: the config's checks, and the commands' own.
  negative = ("--config.train.num_steps=-1",
              "train.num_steps must be an int >= 1; got -1")
  add(f"range/{RUN}", RUN, SMOKE, f"--workdir={out}", negative[0],
      names=negative[1:])
  add(f"range/{EXPORT}", EXPORT, SMOKE, negative[0], names=negative[1:])
  add(f"range/{RUN}/stop_at_step", RUN, SMOKE, f"--workdir={out}",
      "--stop_at_step=0", names=("--stop_at_step=0",), parse=True)
  add(f"range/{ABLATE}/learning_rates", ABLATE, SMOKE, f"--workdir={out}",
      "--learning_rates=1e-3,-1", names=("train.learning_rate", "-1.0"))
  add(f"range/{SWEEP}", SWEEP, SWEEP_SMOKE, f"--workdir={out}",
      "--extend_to=0", names=("--extend_to=0",), parse=True)
  add(f"range/{GENERATE}", GENERATE, f"--workdir={stopped}", "--prompt=ab",
      "--max_new_tokens=0", names=("max_new_tokens must be >= 1",))
  add(f"range/{BENCH}", BENCH, "--heads=0", f"--out={out}/b",
      names=("--heads=0",), parse=True)
  # The argparse scripts: argparse's own line for a bad flag (after its
  # usage line), experiments/tools/cli.py's for what main refuses.
  add("range/benchmarks.decode", "benchmarks.decode", "--rounds=0",
      f"--out={out}/d.json", names=("argument --rounds", "must be an int >= 1"),
      prefix="decode.py")
  add("range/benchmarks.train_loop", "benchmarks.train_loop", "--steps=1",
      "--mixers=kda,foo", names=("model.mixer", "'foo'"))
  add("workdir_file/benchmarks.cp_comm", "benchmarks.cp_comm",
      f"--out={afile}/c.json", names=("argument --out", f"{afile} is a file"),
      prefix="cp_comm.py")
  # A workdir that is a file (or under one).
  for program in (RUN, ABLATE, SWEEP):
    add(f"workdir_file/{program}", program,
        SWEEP_SMOKE if program == SWEEP else SMOKE, f"--workdir={afile}",
        names=(f"workdir {afile} is a file",))
  add(f"workdir_file/{GENERATE}", GENERATE, f"--workdir={afile}",
      "--prompt=ab", names=(afile, "no config.json"))
  # Damaged checkpoints: which checkpoint and file, and what to do.
  add(f"damaged/{GENERATE}", GENERATE, f"--workdir={damaged}", "--prompt=ab",
      names=("checkpoint 4", os.path.join(damaged, "checkpoints", "4"),
             "damaged", "resume from step 2"), dependency_noise=True)
  add(f"damaged/{RUN}", RUN, SMOKE, f"--workdir={ruined}",
      names=(os.path.join(ruined, "checkpoints"), "step 4:", "step 2:",
             "no checkpoint at or before step 4 can be read",
             "remove the run directory"), refused_first=False,
      dependency_noise=True)
  # A config of the wrong kind, and a run of another task.
  add(f"wrong_kind/{SWEEP}", SWEEP, SMOKE, f"--workdir={out}",
      names=("not a sweep config", "configs/sweeps/"))
  add(f"wrong_kind/{RUN}", RUN, "--config=configs/sweeps/text.py",
      f"--workdir={out}", names=("is a sweep config", "experiments.sweep"))
  add(f"wrong_kind/{GENERATE}", GENERATE, f"--workdir={stopped}",
      "--prompt=ab", names=("task 'mqar'", "a 'text' run"))
  # Extending a cosine run: only constant and wsd schedules extend.
  add(f"cosine/{RUN}", RUN, SMOKE, f"--workdir={stopped}",
      "--config.train.num_steps=12",
      names=("train.num_steps: 6 -> 12", "('constant', 'wsd')", "'cosine'"))
  add(f"cosine/{SWEEP}", SWEEP,
      "--config=configs/sweeps/kimi_synthetic_600steps.py", f"--workdir={out}",
      "--extend_to=1000", names=("('constant', 'wsd')", "'cosine'"))
  # Empty or repeated selections, and flags that do not go together.
  add(f"empty/{ABLATE}", ABLATE, SMOKE, f"--workdir={out}", "--mixers=",
      names=("--mixers is empty",))
  add(f"empty/{SWEEP}/no_match", SWEEP, SWEEP_SMOKE, f"--workdir={out}",
      "--list", "--only=mqar_T9999/",
      names=("no run of the sweep matches 'mqar_T9999/'", "palindrome_T16/"))
  add(f"empty/{SWEEP}/empty_only", SWEEP, SWEEP_SMOKE, f"--workdir={out}",
      "--only=", names=("--only is empty",))
  add(f"empty/{SWEEP}/ignored", SWEEP, SWEEP_SMOKE, f"--workdir={out}",
      "--aggregate_only", "--extend_to=50",
      names=("--extend_to would be ignored with --aggregate_only",))
  add(f"empty/{BENCH}", BENCH, "--lengths=", f"--out={out}/b",
      names=("--lengths",))
  # Missing flags and stray words.
  add(f"usage/{RUN}", RUN, SMOKE, names=("--workdir is required",),
      parse=True)
  add(f"usage/{RUN}/positional", RUN, SMOKE, f"--workdir={out}", "smoke",
      names=("unexpected arguments ['smoke']",), parse=True)
  # --verbose: the same line, after the traceback.
  for name in (f"missing_config/{RUN}", f"damaged/{GENERATE}",
               "range/benchmarks.train_loop"):
    case = cases[name]
    cases[name + "/verbose"] = dataclasses.replace(
        case, args=case.args + ("--verbose",))
  return cases


def _command(case):
  program = ([os.path.join(REPO, case.program)] if case.program.endswith(".py")
             else ["-m", case.program])
  # Nothing written under ~/.cache by the commands that cache compilations.
  cache = (["--compilation_cache_dir="]
           if case.program in (RUN, ABLATE, GENERATE) else [])
  return [sys.executable, *program, *cache, *case.args]


# What the fork server imports before it forks: the packages that most of a
# command's ~3 s start goes to (`python -X importtime`: jax and jaxlib,
# matplotlib, orbax, numpy, tensorboardX, haiku, optax). Importing them starts
# no JAX backend (and so no thread of JAX's, nor its warning at a fork); the
# one thread they start, OpenBLAS's, is stopped by OpenBLAS around a fork.
# Nothing of this repository is here: each command imports its own code, and
# defines its flags, as it would in a fresh interpreter (an entry point
# imported beforehand would define its absl flags twice when run as
# __main__).
_PRELOAD = ("numpy", "jax", "jax.numpy", "jax.experimental.pallas",
            "jax.experimental.pallas.tpu", "haiku", "optax",
            "orbax.checkpoint", "tensorboardX", "matplotlib.pyplot",
            "ml_collections.config_flags", "absl.app", "absl.logging")


def _serve(preload):
  """The fork server's loop; its source is run by `python -c`.

  Imports `preload`, then reads requests on stdin, a JSON line each:
  [key, argv, stdout path, stderr path], where argv is what follows the
  interpreter in the command (a script and its arguments, or -m, a module
  and its arguments). Each request is run in a child forked at once; when
  one ends, [key, exit status as subprocess reports it] is written to
  stdout. Ends when stdin is closed and every child has ended.

  Args:
    preload: the modules to import before forking.
  """
  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  import atexit
  import gc
  import importlib
  import json
  import os
  import runpy
  import select
  import sys
  import threading

  def run_in_child(argv, out, err):
    """Runs `python <argv>` in this (forked) process: its exit status."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out), (2, err)):
      f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      os.dup2(f, fd)
      os.close(f)
    # sys.argv and sys.path[0] as the interpreter sets them (runpy puts the
    # program's file in argv[0]); runpy gives the program a fresh __main__,
    # with the module's __spec__ for -m (which names the program in
    # experiments/tools/cli.py).
    try:
      if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
      else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
      status = 0
    except SystemExit as e:
      # The interpreter's reading of sys.exit's argument.
      if e.code is None:
        status = 0
      elif isinstance(e.code, int):
        status = e.code
      else:
        sys.stderr.write(f"{e.code}\n")
        status = 1
    except BaseException as e:  # pylint: disable=broad-except
      # Uncaught: printed as the interpreter prints it, from the program's
      # first frame on (not this server's or runpy's; `python -m` would show
      # two of runpy's above it).
      tb = e.__traceback__
      while tb is not None and (tb.tb_frame.f_code.co_filename == "<string>"
                                or tb.tb_frame.f_globals is vars(runpy)):
        tb = tb.tb_next
      sys.excepthook(type(e), e.with_traceback(tb), tb)
      status = 1
    # Then the interpreter's exit: wait for the program's threads, run the
    # atexit handlers, collect the garbage (the finalizers of the program's
    # unreachable objects run, as in the interpreter's teardown), flush
    # stdout and stderr. The rest of the teardown, every module's, is left
    # out: in a forked child it copies the whole shared heap page by page
    # (~1 s, most of a child's time), and only a finalizer of an object
    # still referenced at exit would print.
    threading._shutdown()  # pylint: disable=protected-access
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        status = 120  # the interpreter's status when stdout will not flush
    return status & 0xFF  # what the process reports of C's exit(status)

  for name in preload:
    importlib.import_module(name)
  # What the children share stays out of their collections (which would
  # otherwise walk, and so copy, the whole imported heap).
  gc.freeze()
  running = {}  # pid -> key
  pending = b""
  reading = True
  while reading or running:
    # A request, or every 20 ms a look for ended children.
    if select.select([0] if reading else [], [], [], 0.02)[0]:
      chunk = os.read(0, 1 << 16)
      reading = bool(chunk)
      *lines, pending = (pending + chunk).split(b"\n")
      for line in lines:
        key, argv, out, err = json.loads(line)
        pid = os.fork()
        if not pid:
          # The child never returns to this loop.
          try:
            os._exit(run_in_child(argv, out, err))
          except BaseException:  # pylint: disable=broad-except
            sys.excepthook(*sys.exc_info())  # this server's own failure
            os._exit(255)
        running[pid] = key
    while running:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if not pid:
        break
      os.write(1, json.dumps([running.pop(pid),
                              os.waitstatus_to_exitcode(status)]).encode()
               + b"\n")


class _ForkServer:
  """Runs commands in processes forked from `_serve` (the module docstring).

  `run` answers as `subprocess.run(command, cwd=REPO, env=env,
  capture_output=True, text=True, timeout=timeout)` does, from any thread.
  """

  def __init__(self, env, folder):
    """Starts the server.

    Args:
      env: the commands' environment (the server's, which they inherit).
      folder: where the commands' stdout and stderr files go.
    """
    self._folder = folder
    self._log = os.path.join(folder, "server.log")
    with open(self._log, "w") as log:
      self._process = subprocess.Popen(
          [sys.executable, "-c",
           f"{inspect.getsource(_serve)}\n_serve({_PRELOAD!r})\n"],
          cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=log, text=True, start_new_session=True)
    self._keys = itertools.count()
    self._lock = threading.Lock()
    self._ended = {}  # key -> Future of the exit status
    self._gone = None  # why the server ended early, once it has
    threading.Thread(target=self._read, daemon=True).start()

  def run(self, command, timeout):
    """Runs `command` (sys.executable first): its CompletedProcess."""
    assert command[0] == sys.executable, command
    ended = concurrent.futures.Future()
    with self._lock:
      if self._gone:
        raise RuntimeError(self._gone)
      key = next(self._keys)
      out, err = (os.path.join(self._folder, f"{key}.{n}")
                  for n in ("stdout", "stderr"))
      self._ended[key] = ended
      try:
        self._process.stdin.write(json.dumps([key, command[1:], out, err])
                                  + "\n")
        self._process.stdin.flush()
      except BrokenPipeError:
        pass  # the server has ended: `_read` says why
    returncode = ended.result(timeout)
    with open(out) as f_out, open(err) as f_err:
      return subprocess.CompletedProcess(command, returncode, f_out.read(),
                                         f_err.read())

  def _read(self):
    """Hands each exit status to its `run`; fails them all if the server
    ends."""
    for line in self._process.stdout:
      key, returncode = json.loads(line)
      with self._lock:
        ended = self._ended.pop(key)
      ended.set_result(returncode)
    returncode = self._process.wait()
    with open(self._log) as f:
      log = f.read()
    with self._lock:
      self._gone = f"the fork server ended (exit status {returncode}):\n{log}"
      waiting, self._ended = self._ended, {}
    for ended in waiting.values():
      ended.set_exception(RuntimeError(self._gone))

  def __enter__(self):
    return self

  def __exit__(self, *unused_exc_info):
    self.close()

  def close(self):
    """Ends the server, and kills what it still runs (after a failure)."""
    self._process.stdin.close()
    with self._lock:
      running = bool(self._ended)
    try:
      self._process.wait(timeout=0 if running else 60)
    except subprocess.TimeoutExpired:
      # The children are in the server's process group (its own session).
      os.killpg(self._process.pid, signal.SIGKILL)
      self._process.wait()


def _truncate_checkpoints(run_dir, steps):
  """Cuts every data file of those checkpoints to half its size (which file
  holds which array varies from one save to the next)."""
  for step in steps:
    data = glob.glob(os.path.join(run_dir, "checkpoints", str(step), "**",
                                  "d", "*"), recursive=True)
    assert data, run_dir
    for path in data:
      os.truncate(path, os.path.getsize(path) // 2)


def _run_cases(tmp):
  """{name: (case, CompletedProcess)} of every case, run concurrently."""
  with open(os.path.join(tmp, "a_file"), "w") as f:
    f.write("not a folder\n")
  cases = _cases(tmp)
  runs = [os.path.join(tmp, d) for d in ("stopped", "damaged", "ruined")]
  needs_run = lambda case: any(r in a for a in case.args for r in runs)
  # Without the suite's shared compilation cache (tests/conftest.py): a read
  # racing another process's write is a warning on stderr, and these
  # commands must print one line.
  env = {n: x for n, x in os.environ.items()
         if n != "JAX_COMPILATION_CACHE_DIR"}
  # The repository ahead of the caller's path (a TPU host brings its
  # packages by PYTHONPATH); the children on the CPU (the parent may hold a
  # chip).
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  with (tempfile.TemporaryDirectory() as folder,
        _ForkServer(env, folder) as server,
        concurrent.futures.ThreadPoolExecutor(3) as pool):
    run = lambda case: server.run(_command(case), timeout=300)
    # The slowest first: benchmarks.train_loop times a model's steps (most of
    # a minute on a busy 2-core machine) before it reaches the mistake.
    first = lambda item: item[1].program != "benchmarks.train_loop"
    futures = {name: pool.submit(run, case)
               for name, case in sorted(cases.items(), key=first)
               if not needs_run(case)}
    # Meanwhile: a cosine smoke run stopped at step 4 of 6 (checkpoints 2
    # and 4), and copies of it with the last checkpoint, or both, damaged.
    train.train_and_evaluate(mqar.get_config("smoke"), runs[0],
                             stop_at_step=4)
    for run_dir, steps in ((runs[1], (4,)), (runs[2], (4, 2))):
      subprocess.run(["cp", "-r", runs[0], run_dir], check=True)
      _truncate_checkpoints(run_dir, steps)
    futures.update({name: pool.submit(run, case)
                    for name, case in cases.items() if needs_run(case)})
    return {name: (cases[name], futures[name].result()) for name in cases}


def _problems(name, case, out):
  """What is wrong with how the command answered `case` ([] if nothing)."""
  lines = out.stderr.rstrip("\n").splitlines()
  last = lines[-1] if lines else ""
  found = []
  if out.returncode != 2:
    found.append(f"exit status {out.returncode}, not 2")
  if not last.startswith(f"{case.program_name}: error: "):
    found.append(f"the last line is not '{case.program_name}: error: ...'")
  found += [f"the last line does not say {n!r}" for n in case.names
            if n not in last]
  if name.endswith("/verbose"):
    if "Traceback (most recent call last)" not in out.stderr[
        :out.stderr.rfind(last)]:
      found.append("--verbose printed no traceback before the line")
  elif case.dependency_noise:
    if f'File "{REPO}' in out.stderr:
      found.append("a traceback through our code")
  else:
    if "Traceback" in out.stderr:
      found.append("a traceback")
    if case.refused_first and "Config:" in out.stderr:
      found.append("the config was logged before the refusal")
    if case.parse and len(lines) != 1:
      found.append(f"{len(lines)} lines on stderr, not 1")
  return found


def test_every_mistake_is_one_line_and_exit_status_2(tmp_path):
  # One test for every case: the processes run together, and pytest-xdist
  # would run a shared fixture once per worker.
  tmp = str(tmp_path)
  results = _run_cases(tmp)
  report = []
  for name, (case, out) in sorted(results.items()):
    problems = _problems(name, case, out)
    if problems:
      report.append(f"{name}: {'; '.join(problems)}\n  {_command(case)}\n"
                    f"  stderr (end):\n{out.stderr[-1500:]}")
  assert not report, f"{len(report)} of {len(results)} cases:\n\n" + (
      "\n\n".join(report))
  # The refused runs left their workdirs as they were.
  assert not os.path.exists(os.path.join(tmp, "out"))
  with open(os.path.join(tmp, "a_file")) as f:
    assert f.read() == "not a folder\n"
  with open(os.path.join(tmp, "stopped", "config.json")) as f:
    assert json.load(f)["train"]["num_steps"] == 6  # not the refused 12
  assert sorted(os.listdir(os.path.join(tmp, "ruined", "checkpoints"))) == [
      "2", "4"]  # the refused resume deleted nothing


def test_the_workdir_check_names_a_file_above_it(tmp_path):
  blocker = tmp_path / "f"
  blocker.write_text("")
  config = mqar.get_config("smoke")
  with pytest.raises(ValueError, match=r"which is a file"):
    train.check_run(config, str(blocker / "a" / "b"))
  train.check_run(config, str(tmp_path / "new" / "run"))  # created later
  assert not os.path.exists(tmp_path / "new")


def test_extending_a_constant_run_is_not_refused(tmp_path):
  # The cosine refusal is about the schedule, not any raised num_steps.
  config = config_lib.apply_diff(mqar.get_config("smoke"),
                                 {"train.schedule": "constant"})
  workdir = str(tmp_path)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort())
  train.check_run(config_lib.apply_diff(config, {"train.num_steps": 12}),
                  workdir)
  with pytest.raises(ValueError, match=r"train.learning_rate: 0.003 -> 0.01"
                     r"\): use a new workdir"):
    train.check_run(config_lib.apply_diff(
        config, {"train.learning_rate": 0.01}), workdir)


def test_the_checks_behind_the_commands_name_the_field(tmp_path):
  # In-process, the checks some cases above reach through a command.
  from experiments.sweeps import ablate  # pylint: disable=g-import-not-at-top
  config = mqar.get_config("smoke")
  with pytest.raises(ValueError, match=r"model.kda: num_heads must be an int"
                     r" >= 1; got 0"):
    train.validate_config(config_lib.apply_diff(
        config, {"model.kda.num_heads": 0}))
  # A mixer's section is checked when a layer runs that mixer.
  for diff, match in (({"train.b2": 1.0}, r"train.b2 must be in \[0, 1\)"),
                      ({"model.mixer": "attention",
                        "model.attention.conv_size": -1},
                       r"model.attention: conv_size must be an int >= 0")):
    with pytest.raises(ValueError, match=match):
      train.validate_config(config_lib.apply_diff(config, diff))
  for mixers, seeds, match in ((["kda", "none", "kda"], [0],
                                r"--mixers repeats \['kda'\]"),
                               (["kda"], [], "--seeds is empty")):
    with pytest.raises(ValueError, match=match):
      ablate.ablation_runs(config, str(tmp_path), mixers, seeds, [1e-3])
