"""The base of every op's backend enum: one `parse` with one error message."""

import enum


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
