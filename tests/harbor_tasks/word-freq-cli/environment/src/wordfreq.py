"""Word frequencies of a file (to be written)."""
import sys


def main(argv):
    raise SystemExit("not implemented")


if __name__ == "__main__":
    main(sys.argv[1:])
