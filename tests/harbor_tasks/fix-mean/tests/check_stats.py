import sys
import unittest

sys.path.insert(0, "/app")
import stats  # noqa: E402


class Stats(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(stats.mean([1, 2]), 1.5)
        self.assertIsInstance(stats.mean([2, 2]), float)

    def test_mean_empty(self):
        with self.assertRaises(ValueError):
            stats.mean([])

    def test_median(self):
        self.assertEqual(stats.median([3, 1, 2]), 2)
        self.assertEqual(stats.median([4, 1, 3, 2]), 2.5)


if __name__ == "__main__":
    unittest.main()
