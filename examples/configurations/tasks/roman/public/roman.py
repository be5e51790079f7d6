"""Conversion between integers and Roman numerals.

The full specification is in TASK.md.
"""


def to_roman(n):
    """Return the canonical Roman numeral for ``n`` (an int in 1..3999).

    Raises ValueError for anything else.
    """
    raise NotImplementedError("to_roman is not implemented yet")


def from_roman(s):
    """Return the integer value of the canonical Roman numeral ``s``.

    Raises ValueError for anything that is not a canonical numeral.
    """
    raise NotImplementedError("from_roman is not implemented yet")
