"""Conversion between integers and Roman numerals.

The full specification is in TASK.md.
"""

_SYMBOLS = (
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"),
    (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
    (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
)
_LETTER_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def to_roman(n):
    """Return the Roman numeral for ``n``."""
    parts = []
    for value, symbol in _SYMBOLS:
        count, n = divmod(n, value)
        parts.append(symbol * count)
    return "".join(parts)


def from_roman(s):
    """Return the integer value of the Roman numeral ``s``."""
    if not s:
        raise ValueError("empty numeral")
    total = 0
    for i, letter in enumerate(s):
        if letter not in _LETTER_VALUES:
            raise ValueError(f"invalid character {letter!r}")
        value = _LETTER_VALUES[letter]
        if i + 1 < len(s) and _LETTER_VALUES.get(s[i + 1], 0) > value:
            total -= value
        else:
            total += value
    return total
