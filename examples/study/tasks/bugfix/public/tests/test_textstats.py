"""Public checks for the bugfix task.

They run with the workspace as the current directory, so the module under test is imported from
there (the test file itself may live elsewhere).
"""
import os
import sys
import unittest

sys.path.insert(0, os.getcwd())

import textstats  # noqa: E402  (imported after the path set-up on purpose)

SAMPLE = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
          "it was the age of foolishness")


class WrapTest(unittest.TestCase):
    def test_reported_case(self):
        self.assertEqual(textstats.wrap("the cat sat on the mat", 7),
                         ["the cat", "sat on", "the mat"])

    def test_lines_fit_and_keep_every_word(self):
        for width in range(5, 21):
            with self.subTest(width=width):
                lines = textstats.wrap(SAMPLE, width)
                self.assertEqual(" ".join(lines).split(), SAMPLE.split())
                for line in lines:
                    self.assertTrue(len(line) <= width or " " not in line, line)

    def test_long_word_stays_whole(self):
        self.assertEqual(textstats.wrap("a extraordinarily b", 5),
                         ["a", "extraordinarily", "b"])

    def test_blank_text(self):
        self.assertEqual(textstats.wrap("   ", 10), [])


class WordsTest(unittest.TestCase):
    def test_case_insensitive_counts(self):
        self.assertEqual(textstats.word_counts("The cat and the hat."),
                         {"the": 2, "cat": 1, "and": 1, "hat": 1})

    def test_apostrophes(self):
        self.assertEqual(textstats.words("Don't stop, don't!"), ["don't", "stop", "don't"])

    def test_top_words(self):
        self.assertEqual(textstats.top_words(SAMPLE, 3), [("it", 4), ("of", 4), ("the", 4)])


if __name__ == "__main__":
    unittest.main()
