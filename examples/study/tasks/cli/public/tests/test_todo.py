"""Public checks for the cli task.

They run with the workspace as the current directory and start the tool from there in a
subprocess, with its data file in a temporary directory.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

TODO = os.path.join(os.getcwd(), "todo.py")


def run_todo(data_file, *args):
    """Run the tool on data_file; return the CompletedProcess (text mode, UTF-8)."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, TODO, "--file", data_file, *args],
                          capture_output=True, text=True, encoding="utf-8", env=env,
                          cwd=os.path.dirname(data_file), timeout=60)


class TodoTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.data_file = os.path.join(self._tmp.name, "todo.json")

    def tearDown(self):
        self._tmp.cleanup()

    def add(self, text):
        proc = run_todo(self.data_file, "add", text)
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def test_add_and_list(self):
        self.add("buy milk")
        proc = run_todo(self.data_file, "list")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.splitlines(), ["[ ] 1 buy milk"])

    def test_done_marks_item(self):
        self.add("buy milk")
        self.add("call mum")
        proc = run_todo(self.data_file, "done", "2")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        proc = run_todo(self.data_file, "list")
        self.assertEqual(proc.stdout.splitlines(), ["[ ] 1 buy milk", "[x] 2 call mum"])

    def test_list_json(self):
        self.add("buy milk")
        self.add("call mum")
        self.assertEqual(run_todo(self.data_file, "done", "1").returncode, 0)
        proc = run_todo(self.data_file, "list", "--json")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(json.loads(proc.stdout), [
            {"id": 1, "text": "buy milk", "done": True},
            {"id": 2, "text": "call mum", "done": False},
        ])


if __name__ == "__main__":
    unittest.main()
