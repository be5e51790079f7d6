#!/usr/bin/env python3
"""todo: a tiny to-do list kept in a JSON file.

Usage:
    python todo.py [--file PATH] add TEXT...
    python todo.py [--file PATH] list [--json]
    python todo.py [--file PATH] done ID

The file holds {"next_id": int, "items": [{"id": int, "text": str, "done": bool}, ...]}; a
missing file is an empty list.
"""
import argparse
import json
import os
import sys

DEFAULT_FILE = "todo.json"


def load(path):
    """Return the stored data, or an empty store when the file does not exist."""
    if not os.path.exists(path):
        return {"next_id": 1, "items": []}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def save(path, data):
    """Write the store atomically: a crash never leaves a half-written file."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    os.replace(tmp, path)


def cmd_add(args):
    data = load(args.file)
    text = " ".join(args.text).strip()
    if not text:
        print("todo: the item text is empty", file=sys.stderr)
        return 1
    item = {"id": data["next_id"], "text": text, "done": False}
    data["items"].append(item)
    data["next_id"] += 1
    save(args.file, data)
    print(f"added {item['id']}: {text}")
    return 0


def cmd_list(args):
    data = load(args.file)
    if args.json:
        # Exactly the three documented keys, whatever else an item may carry in the file.
        items = [{"id": item["id"], "text": item["text"], "done": bool(item["done"])}
                 for item in sorted(data["items"], key=lambda item: item["id"])]
        print(json.dumps(items))
        return 0
    for item in data["items"]:
        mark = "x" if item["done"] else " "
        print(f"[{mark}] {item['id']} {item['text']}")
    return 0


def cmd_done(args):
    data = load(args.file)
    item = next((item for item in data["items"] if item["id"] == args.id), None)
    if item is None:
        # Checked before any write, so an unknown id never creates or rewrites the file.
        print(f"todo: no item with id {args.id}", file=sys.stderr)
        return 1
    if item["done"]:
        print(f"already done {item['id']}: {item['text']}")
        return 0
    item["done"] = True
    save(args.file, data)
    print(f"done {item['id']}: {item['text']}")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="todo", description="A tiny to-do list.")
    parser.add_argument("--file", default=DEFAULT_FILE, help="the JSON file (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    add = sub.add_parser("add", help="add an item")
    add.add_argument("text", nargs="+", help="the item text")
    add.set_defaults(func=cmd_add)

    lst = sub.add_parser("list", help="list the items")
    lst.add_argument("--json", action="store_true", help="print the items as a JSON array")
    lst.set_defaults(func=cmd_list)

    done = sub.add_parser("done", help="mark an item as done")
    done.add_argument("id", type=int, help="the item id")
    done.set_defaults(func=cmd_done)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
