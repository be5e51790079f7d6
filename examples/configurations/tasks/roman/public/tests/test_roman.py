"""Public checks for the roman task.

They run with the workspace as the current directory, so the module under test is imported from
there (the test file itself may live elsewhere).
"""
import os
import sys
import unittest

sys.path.insert(0, os.getcwd())

import roman  # noqa: E402  (imported after the path set-up on purpose)


class ToRomanTest(unittest.TestCase):
    def test_small_values(self):
        for n, expected in [(1, "I"), (3, "III"), (4, "IV"), (9, "IX"), (14, "XIV")]:
            with self.subTest(n=n):
                self.assertEqual(roman.to_roman(n), expected)

    def test_large_values(self):
        for n, expected in [(1994, "MCMXCIV"), (2024, "MMXXIV"), (3999, "MMMCMXCIX")]:
            with self.subTest(n=n):
                self.assertEqual(roman.to_roman(n), expected)

    def test_out_of_range(self):
        for n in (0, 4000):
            with self.subTest(n=n):
                with self.assertRaises(ValueError):
                    roman.to_roman(n)


class FromRomanTest(unittest.TestCase):
    def test_values(self):
        for s, expected in [("I", 1), ("IV", 4), ("XLII", 42), ("MCMXCIV", 1994)]:
            with self.subTest(s=s):
                self.assertEqual(roman.from_roman(s), expected)

    def test_empty_string(self):
        with self.assertRaises(ValueError):
            roman.from_roman("")


if __name__ == "__main__":
    unittest.main()
