"""Argument checks of the op layer: every `ValueError` an op or layer raises
for bad input is written here once.

Each check names the argument and what it accepts ("x must be an int >= 1;
got 0.") so a message reads the same wherever it comes from. Three kinds:

* Python values (static arguments): `int_at_least`, `boolean`,
  `positive_number`, `finite_in`, `one_of`, `mesh_axis_name`;
* arrays by shape and dtype (checked while tracing, at no run-time cost):
  `rank`, `shape`, `floating`, `integer_array`;
* arrays by value (`values_in`): only concrete arrays can be read, so
  these skip traced values (under `jit` or `grad`) and say so in their
  docstring. A new value check (ids in range, finite inputs, ...) is one
  more function of this kind, built on `concrete`.

Checks return None and raise `ValueError`; a backend's limits are not
input errors and are not here (each backend's `supports`).
"""

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _fail(name: str, want: str, got: Any) -> None:
  raise ValueError(f"{name} must be {want}; got {got!r}.")


def is_int(value) -> bool:
  """An int (Python or NumPy), not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
  """An int or float (Python or NumPy), not a bool."""
  return isinstance(value, (int, float, np.integer, np.floating)) and (
      not isinstance(value, bool))


# Python values ---------------------------------------------------------------


def int_at_least(name: str, value, low: int, *, optional: bool = False,
                 note: str = "") -> None:
  """`value` is an int >= low (or None when `optional`)."""
  if optional and value is None:
    return
  if not (is_int(value) and value >= low):
    _fail(name, ("None or " if optional else "") + f"an int >= {low}" + note,
          value)


def boolean(name: str, value) -> None:
  """`value` is True or False."""
  if not isinstance(value, bool):
    _fail(name, "a bool", value)


def positive_number(name: str, value, *, optional: bool = False) -> None:
  """`value` is a finite number > 0 (or None when `optional`)."""
  if optional and value is None:
    return
  if not (is_number(value) and math.isfinite(value) and value > 0):
    _fail(name, ("None or " if optional else "") + "a positive finite number",
          value)


def finite_in(name: str, value, low: float, high: float, *,
              optional: bool = False) -> None:
  """`value` is a finite number in [low, high) (or None when `optional`)."""
  if optional and value is None:
    return
  if not (is_number(value) and math.isfinite(value) and low <= value < high):
    _fail(name, ("None or " if optional else "")
          + f"a finite number in [{low}, {high:g})", value)


def one_of(name: str, value, options: Sequence, *, optional: bool = False
           ) -> None:
  """`value` is one of `options` (or None when `optional`)."""
  if optional and value is None:
    return
  if not (isinstance(value, (type(None), str, int, float))
          and value in tuple(options)):
    _fail(name, ("None or " if optional else "") + f"one of {tuple(options)}",
          value)


def mesh_axis_name(name: str, value, *, axes: Sequence[str] | None = None
                   ) -> None:
  """`value` is None or a str naming a mesh axis (one of `axes` if given)."""
  if value is None:
    return
  if axes is None and not isinstance(value, str):
    _fail(name, "None or the str name of a mesh axis", value)
  if axes is not None and not (isinstance(value, str) and value in axes):
    _fail(name, f"None or one of the mesh's axes {tuple(axes)}", value)


# Arrays by shape and dtype ---------------------------------------------------


def rank(name: str, x, ndim: int, layout: str) -> None:
  """`x` has `ndim` axes; `layout` names them, e.g. "[B, T, C]"."""
  if getattr(x, "ndim", None) != ndim:
    raise ValueError(f"{name} must have shape {layout}; got"
                     f" {tuple(getattr(x, 'shape', ())) or x!r}.")


def shape(name: str, x, expected: Sequence[int], layout: str) -> None:
  """`x` (None passes) has shape `expected`, named `layout` in the message."""
  if x is None:
    return
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {layout} = {tuple(expected)};"
                     f" got {tuple(x.shape)}.")


def floating(name: str, x) -> None:
  """`x` has a floating dtype."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating dtype; got {x.dtype}.")


def integer_array(name: str, x) -> None:
  """`x` (None passes) has an integer dtype."""
  if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array; got {x.dtype}.")


# Arrays by value (concrete arrays only) --------------------------------------


def concrete(x) -> np.ndarray | None:
  """`x` as a float64 NumPy array, or None when it is traced (unreadable)."""
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  return np.asarray(jax.device_get(x), np.float64)


def _offenders(values: np.ndarray, bad: np.ndarray, limit: int = 3) -> str:
  """'N value(s) outside, e.g. 1.5 at (0, 3, 1), nan at (1, 0, 0)'."""
  where = np.argwhere(bad)
  shown = ", ".join(
      f"{values[tuple(i)]:g} at {tuple(int(j) for j in i)}"
      for i in where[:limit])
  more = "" if len(where) <= limit else ", ..."
  return f"{len(where)} value(s) outside: {shown}{more}"


def values_in(name: str, x, low: float, high: float, *, hint: str = ""
              ) -> None:
  """Every value of a concrete `x` lies in [low, high] (NaN does not);
  traced `x` passes (see `in_range` for the traced case)."""
  values = concrete(x)
  if values is None or not values.size:
    return
  bad = ~((values >= low) & (values <= high))  # NaN compares False: bad
  if bad.any():
    raise ValueError(f"{name} must lie in [{low:g}, {high:g}]{hint}; got"
                     f" {_offenders(values, bad)}.")


def in_range(x, low: float, high: float) -> jax.Array:
  """Elementwise `low <= x <= high` (False for NaN), traced or not: what
  an op uses to mark the rows of out-of-range traced input."""
  return (x >= low) & (x <= high)
