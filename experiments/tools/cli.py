"""What every command line shares: a mistake in the command is one line.

`run(main)` is `absl.app.run(main)` for the entry points (run_experiment.py,
`python -m experiments.ablate`, `.sweep`, `.generate`, `.export_tpu`,
`benchmarks.kda_error_vs_length`). A mistake in the command ends the
process with exit status 2 (`EXIT_MISTAKE`) and one line on stderr,
`<program>: error: <what is wrong, naming the flag, field or file>`, with
nothing of the config or of a traceback before it; `--verbose` prints the
traceback above that line. Anything else (a bug) raises as usual, with its
traceback and exit status 1.

A mistake is:

* an error while parsing the flags (absl's own, and ml_collections' config
  flags: a config file that is missing or does not load, an override of a
  field the config does not have, with ml_collections' suggestion, a value
  of the wrong type);
* `app.UsageError` (what a `main` refuses: a missing flag, an empty list);
* `ValueError` or `NotImplementedError` raised by this repository's code (its
  convention for bad input and for a backend's limit: a field out of range,
  a workdir that is a file or holds another config's run, a damaged
  checkpoint); one raised inside a dependency is not classed as the user's
  mistake and keeps its traceback;
* an `OSError` about a path the command named (no such file or folder, a
  file where a folder belongs, no permission).

The argparse scripts (benchmarks/) end with `run_script(main)`: argparse
already refuses a bad flag with exit status 2 and one line; `run_script`
adds `--verbose` and the same handling of the mistakes `main` raises, and
the argument types here (`positive_int`, `positive_ints`, `output_path`,
`output_folder`)
refuse a count below 1, an empty list or an output under a file before any
work starts.

Flags are read in the `main`s; this module reads `--verbose` (and, when the
flags did not parse, looks for it in the command line).
"""

import argparse
import os
import re
import sys
import traceback
from typing import Callable, Sequence

from absl import app
from absl import flags
import ml_collections
from ml_collections import config_flags

EXIT_MISTAKE = 2
VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On a mistake in the command (exit status 2), print the"
    " traceback above its one-line message.")
# `run` declares --verbose a key flag of the module that calls it (the
# entry point), so that its --help lists it.
flags.disclaim_key_flags()

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_OWN_CODE = tuple(os.path.join(_ROOT, d) + os.sep
                  for d in ("configs", "experiments", "linear_attention",
                            "benchmarks")) + (
                                os.path.join(_ROOT, "run_experiment.py"),)
_ML_COLLECTIONS = (os.path.dirname(os.path.abspath(ml_collections.__file__))
                   + os.sep,)
_PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError,
                IsADirectoryError, PermissionError)
# Python's words for a value of the wrong type, and ours.
_TYPE_ERRORS = (
    (r"invalid literal for int\(\) with base 10: (.*)$",
     r"must be an int; got \1."),
    (r"could not convert string to float: (.*)$", r"must be a number; got \1."),
)
# ml_collections' KeyError for an unknown field: "'num_step'\nDid you mean
# "num_steps" instead of "num_step"?"
_SUGGESTION = re.compile(r"'([^']+)'.*Did you mean \"([^\"]+)\"", re.S)


def run(main: Callable[[list[str]], int | None], *,
        flags_parser: Callable[[list[str]], list[str]] | None = None) -> None:
  """`app.run(main)`, a mistake in the command as one line and exit 2.

  Args:
    main: the entry point; called with argv holding the program only (the
      default parser refuses positional arguments), or what `flags_parser`
      returns.
    flags_parser: as app.run's; None parses `flags.FLAGS` and refuses
      positional arguments.
  """

  def parse(argv):
    try:
      if flags_parser is not None:
        return flags_parser(argv)
      rest = flags.FLAGS(argv)
      check_config_flags(flags.FLAGS)
      if len(rest) > 1:
        raise app.UsageError(
            f"unexpected arguments {rest[1:]}: every option is a --flag.")
      return rest
    except Exception as e:  # pylint: disable=broad-except
      if not is_parse_mistake(e):
        raise
      sys.exit(report(e, argv))

  def guarded(argv):
    try:
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except
      if not is_mistake(e):
        raise
      return report(e, sys.argv)

  flags.declare_key_flag(VERBOSE)
  app.run(guarded, flags_parser=parse)


def run_script(main: Callable[[], int | None]) -> None:
  """Runs an argparse script's `main()`: a mistake is one line, exit 2.

  `--verbose` is taken out of sys.argv here (the script's parser does not
  define it) and prints the traceback above the line.
  """
  verbose = "--verbose" in sys.argv
  argv = list(sys.argv)
  sys.argv[:] = [a for a in sys.argv if a != "--verbose"]
  try:
    status = main()
  except Exception as e:  # pylint: disable=broad-except
    if not is_mistake(e):
      raise
    status = report(e, argv + (["--verbose"] if verbose else []))
  sys.exit(status)


def positive_int(text: str) -> int:
  """argparse type: an int >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an int >= 1; got {text!r}")
  return value


def positive_ints(text: str) -> list[int]:
  """argparse type: a comma-separated, non-empty list of ints >= 1."""
  try:
    return [positive_int(x) for x in text.split(",")]
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(
        f"must be a comma-separated list of ints >= 1; got {text!r}") from None


def output_path(text: str) -> str:
  """argparse type: a path whose folder is, or can be made, a folder."""
  from experiments.training import metrics  # pylint: disable=g-import-not-at-top
  try:
    metrics.check_folder(os.path.dirname(text) or ".", "its folder")
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


def output_folder(text: str) -> str:
  """argparse type: a folder, or a path where one can be made."""
  return os.path.dirname(output_path(os.path.join(text, "x")))


def is_parse_mistake(e: BaseException) -> bool:
  """Whether `e`, raised while parsing the flags, is the command's fault.

  absl's flag errors (a config file's own ValueError reaches us as one),
  what the parser refuses (app.UsageError), and what ml_collections raises
  for an override of a field the config lacks (KeyError, AttributeError);
  not an error of ours while parsing.
  """
  if isinstance(e, (flags.Error, app.UsageError)):
    return True
  return isinstance(e, (KeyError, AttributeError, OSError, ValueError)) and (
      _raised_in(e, _ML_COLLECTIONS))


def is_mistake(e: BaseException) -> bool:
  """Whether `e`, raised by a `main`, is a mistake in the command."""
  if isinstance(e, (app.UsageError, flags.Error)):
    return True
  if isinstance(e, _PATH_ERRORS) and e.filename is not None:
    return True
  if isinstance(e, (ValueError, NotImplementedError)):
    return _raised_in(e, _OWN_CODE)
  return False


def _raised_in(e: BaseException, places: tuple[str, ...]) -> bool:
  """Whether the frame that raised `e` is in a file under `places`."""
  tb = e.__traceback__
  if tb is None:
    return False
  while tb.tb_next is not None:
    tb = tb.tb_next
  return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(places)


def check_config_flags(flag_values: flags.FlagValues) -> None:
  """Raises app.UsageError for a config flag whose file did not load.

  ml_collections defers that error to the config's first use, after the run
  has started; this names the file before anything runs.
  """
  for name in list(flag_values):
    flag = flag_values[name]
    if name != flag.name or not flag.present:
      continue
    try:
      argument = config_flags.get_config_filename(flag)
    except TypeError:  # not a config flag
      continue
    value = flag.value
    if value is None or isinstance(value, ml_collections.ConfigDict):
      continue
    path = argument.split(":", 1)[0]
    if not os.path.isfile(path):
      raise app.UsageError(
          f"--{name}={argument}: there is no config file {path!r} (relative"
          f" to {os.getcwd()}); the experiment configs are configs/*.py and"
          " the sweep configs configs/sweeps/*.py, at the repository root.")
    try:
      value.lock()
    except OSError as e:
      cause = e.__cause__ or e
      raise app.UsageError(f"--{name}={argument}: {path} does not load:"
                           f" {_one_line(cause)}") from e


def report(e: BaseException, argv: Sequence[str]) -> int:
  """Prints `e` as a mistake (its traceback too under --verbose); returns
  EXIT_MISTAKE."""
  if _verbose(argv):
    traceback.print_exception(e, file=sys.stderr)
  sys.stderr.write(f"{_program(argv)}: error: {message(e, argv)}\n")
  sys.stderr.flush()
  return EXIT_MISTAKE


def _verbose(argv: Sequence[str]) -> bool:
  if flags.FLAGS.is_parsed() and VERBOSE.value:
    return True
  return any(a in ("--verbose", "-verbose", "--verbose=true", "--verbose=1",
                   "--verbose=True") for a in argv)


def _program(argv: Sequence[str]) -> str:
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name not in (None, "__main__"):
    return spec.name  # python -m experiments.sweep
  return os.path.basename(argv[0]) if argv else "error"


def _one_line(e: BaseException) -> str:
  """The message of `e` on one line."""
  if isinstance(e, _PATH_ERRORS + (OSError,)) and e.filename is not None:
    return f"{e.filename}: {e.strerror or e}."
  text = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else (
      str(e))
  return " ".join(text.split())


def message(e: BaseException, argv: Sequence[str] = ()) -> str:
  """What the user did wrong, on one line, naming the flag or field."""
  # ml_collections: an override of a field the config does not have.
  if isinstance(e, (KeyError, AttributeError)):
    inner = e
    while inner.args and isinstance(inner.args[0], BaseException):
      inner = inner.args[0]
    text = inner.args[0] if inner.args else str(inner)
    match = _SUGGESTION.search(str(text))
    if match:
      field, suggestion = match.group(1), match.group(2)
      flag = _override_naming(field, argv)
      return (f"{flag}: the config has no field {field!r}; did you mean"
              f" {suggestion!r}?")
    path = re.search(r"Attempting to lookup: (\S+)", str(text))
    where = f"--config.{path.group(1)}" if path else "a --config override"
    return (f"{where} names no field of the config"
            f" ({' '.join(str(text).split())}).")
  text = _one_line(e)
  if isinstance(e, flags.Error):
    text = text.removeprefix("flag ")
    # A config file's get_config raised: its message is the trace's last line.
    if "Error whilst parsing config file" in text:
      flag = text.split(": Error whilst parsing config file", 1)[0]
      last = str(e).strip().splitlines()[-1]
      text = f"{flag}: {last.split(': ', 1)[-1].strip()}"
    required = re.search(r"Flag --(\S+) must have a value other than None",
                         text)
    if required:
      text = f"--{required.group(1)} is required."
    for python_says, we_say in _TYPE_ERRORS:
      text = re.sub(python_says, we_say, text)
  return text


def _override_naming(field: str, argv: Sequence[str]) -> str:
  """The --config.<path> argument whose path holds `field` (for the line)."""
  for arg in argv:
    name = arg.lstrip("-").split("=", 1)[0]
    if "." in name and field in name.split(".")[1:]:
      return "--" + name
  return f"a --config override of {field!r}"
