#!/bin/bash
cat > /app/wordfreq.py <<'PY'
"""Word frequencies of a file."""
import argparse
import collections
import re
import sys


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("-n", type=int, default=3)
    args = p.parse_args(argv)
    try:
        with open(args.file, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        print(f"wordfreq: {exc}", file=sys.stderr)
        return 2
    counts = collections.Counter(w.lower() for w in re.findall(r"[^\W\d_]+", text))
    for word, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:args.n]:
        print(f"{word} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PY
