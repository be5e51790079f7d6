"""Conversion between integers and Roman numerals.

The full specification is in TASK.md.
"""

# Greedy table, largest first; the subtractive pairs are listed as single symbols so that the
# greedy walk produces the canonical spelling directly.
_SYMBOLS = (
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"),
    (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
    (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
)
_LETTER_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def to_roman(n):
    """Return the canonical Roman numeral for ``n`` (an int in 1..3999).

    Raises ValueError for anything else.
    """
    # bool is a subclass of int, but True is not a number a caller means to convert.
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"expected an int, got {type(n).__name__}")
    if not 1 <= n <= 3999:
        raise ValueError(f"{n} is outside 1..3999")
    parts = []
    for value, symbol in _SYMBOLS:
        count, n = divmod(n, value)
        parts.append(symbol * count)
    return "".join(parts)


def from_roman(s):
    """Return the integer value of the canonical Roman numeral ``s``.

    Raises ValueError for anything that is not a canonical numeral.
    """
    if not isinstance(s, str):
        raise ValueError(f"expected a str, got {type(s).__name__}")
    if not s:
        raise ValueError("empty numeral")
    total = 0
    for i, letter in enumerate(s):
        if letter not in _LETTER_VALUES:
            raise ValueError(f"invalid character {letter!r} in {s!r}")
        value = _LETTER_VALUES[letter]
        following = _LETTER_VALUES.get(s[i + 1]) if i + 1 < len(s) else None
        total += -value if following is not None and following > value else value
    # The value alone accepts spellings like "IIII" or "VX"; only the canonical spelling of the
    # value is a valid numeral, so compare against it.
    if not 1 <= total <= 3999 or to_roman(total) != s:
        raise ValueError(f"{s!r} is not a canonical Roman numeral")
    return total
