"""Small text statistics helpers for reports.

The docstrings below are the specification of each function.
"""
import re
from collections import Counter

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


def words(text):
    """Return the words of ``text`` in order, case-folded.

    A word is a maximal run of Unicode letters or digits (any script: "café", "Straße", "東京",
    "42"). A single apostrophe (') between two such characters joins them into one word
    ("don't", "rock'n'roll"); every other character, the underscore included, separates words.
    Words are compared case-insensitively with full Unicode case folding (``str.casefold``), so
    "Straße" and "STRASSE" are the same word; the returned words are the case-folded forms.
    """
    return _WORD_RE.findall(text.lower())


def word_counts(text):
    """Return a dict mapping each word of ``text`` (as returned by ``words``) to its count."""
    return dict(Counter(words(text)))


def top_words(text, n):
    """Return the ``n`` most frequent words of ``text`` as (word, count) pairs.

    Pairs are sorted by count, highest first; ties are broken by the word in plain string order.
    Fewer than ``n`` pairs are returned when the text has fewer distinct words. ``n == 0``
    returns an empty list; a negative ``n`` raises ValueError.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    ranked = sorted(word_counts(text).items(), key=lambda item: (-item[1], item[0]))
    return ranked[:n]


def wrap(text, width):
    """Greedy word wrap of ``text`` into lines of at most ``width`` characters.

    The text is split on whitespace. Words are packed in order into lines, joined by single
    spaces; each line takes as many words as fit without exceeding ``width`` characters. A word
    longer than ``width`` goes on a line of its own, unbroken. Returns the list of lines (an
    empty list for blank text). A ``width`` below 1 raises ValueError.
    """
    if width < 1:
        raise ValueError("width must be >= 1")
    lines = []
    current = ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
