"""The base of every op's backend enum: one `parse` with one error message,
and the one log-once of backend choices (KDA's policy and CSA's dispatch)."""

import enum

from absl import logging

_logged: set[tuple] = set()


def log_once(key: tuple, msg: str, *args) -> None:
  """`logging.info(msg, *args)` the first time `key` is seen in a process."""
  if key not in _logged:
    _logged.add(key)
    logging.info(msg, *args)


class BackendEnum(enum.Enum):
  """An enum of implementations, parsed once from a config string."""

  @classmethod
  def parse(cls, value):
    """Returns the member for `value` (a member or its string value)."""
    if isinstance(value, cls):
      return value
    try:
      return cls(value)
    except ValueError:
      raise ValueError(
          f"backend must be one of {[b.value for b in cls]}; got {value!r}."
      ) from None
