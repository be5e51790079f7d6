#!/usr/bin/env python3
"""A fake `claude` executable for fast, deterministic supervisor tests (standard library only).

It accepts the launch flags agentbench passes to the real Claude Code CLI (`-p --output-format
stream-json --verbose --model --effort --permission-mode --tools --allowedTools --disallowedTools
--strict-mcp-config --mcp-config --append-system-prompt-file --session-id --resume --fork-session
--max-budget-usd --max-turns`, and `--version`), refuses the rest as the real one does (stderr,
exit 1), reads the prompt from stdin until EOF (an open stdin blocks it), and prints the stream the
real 2.1.x binary prints: `system/init`, `assistant` and `user` events, then a `result` event.

Sessions behave as in the real binary: the transcript is
`$CLAUDE_CONFIG_DIR/projects/<cwd, every non-alphanumeric as '-'>/<session>.jsonl` (default config
dir `~/.claude`); the running totals are saved in it as a `cost-state` line when a call ends with
a result, so `--resume ID` and `--resume ID --fork-session [--session-id NEW]` report a
CUMULATIVE `total_cost_usd` and `modelUsage`, while `usage`, `num_turns` and
`model_usage_since_last_result` are per call.  `--max-budget-usd` counts only this call's spend.
Exit codes: 0 for a success, 1 for every error result (as observed on the real binary).

Directive lines in the prompt steer one call: `FAKE: key=value` or `FAKE: key`, one per line.

  cost=USD          this call's cost (default 0.01), spread evenly over its API responses
  tokens=IN,OUT,CC,CR  this call's usage (default 100,50,0,0), spread over its responses
  cc1h=N            the part of CC written to the 1-hour cache (the rest is 5-minute)
  tool_uses=N       N rounds of a Bash `echo i` tool_use and its tool_result, then the answer
  tool=NAME JSON    one extra tool_use round with that input (repeatable; runs before the echoes)
  deny=COMMAND      a Bash tool_use a permission rule refuses (error tool_result, listed in
                    `permission_denials`; repeatable)
  tool_delay=S      pause S seconds before each tool_result
  turns=N           report num_turns N (default: tool uses + 1)
  split             each API response as 3 events sharing message.id, one content block each,
                    with an early output_tokens snapshot below the final count
  text=TEXT         the final answer (default "Done.")
  sleep=S           stay silent S seconds before the result
  hang              print init, then block forever without output
  crash             print init and one assistant event, exit 3 without a result or saved totals
  exit=N            print the normal result, then exit N
  malformed         add a non-JSON line, a truncated JSON line and an event of an unknown type
  model=ID          the responses report model ID (assistant events only: like the real
                    binary, modelUsage stays keyed by the requested model)
  remap=ID          the binary remapped the requested model to ID (init, events, modelUsage)
  api_error=KIND    end with the real API-error shape: synthetic assistant message, then result
                    subtype success, is_error true, api_error_status; KIND is one of
                    429, 529, 500, prompt_too_long, auth
  is_error_exit0    result subtype success with is_error true, exit 0 (also with api_error)
  double_result     an interim result before the final answer; the last result holds the totals
  budget_exceed     stop with error_max_budget_usd after the first response (also happens by
                    itself when this call's spend reaches --max-budget-usd)
  child=S           leave a grandchild `sleep S` process behind (same session, stdio on
                    /dev/null) that outlives the fake; child_pidfile=PATH receives its pid
  write=REL:TEXT    write TEXT (a literal backslash-n is a newline) to REL under the cwd
  stderr=TEXT       print TEXT on stderr (repeatable)
  escape=S          leave a process that escapes the tree: a double fork whose grandchild calls
                    setsid and sleeps S seconds; escape_pidfile=PATH receives its pid
  raw=LINE          print LINE verbatim on stdout after the init event (repeatable; hostile
                    streams: `Infinity`, `1e400`, content that is not a list)
  result_splice=JSON  JSON members spliced verbatim into every result line; later members win
                    (`"total_cost_usd":NaN`)

`--max-turns N` below the turns a call needs gives N tool rounds, then `error_max_turns`
(num_turns N+1).  An unknown directive or a bad value exits 2, so that a typo in a test cannot
silently fall back to the default behaviour.

If `FAKE_CLAUDE_LOG` names a file, one JSON line per invocation is appended to it (argv, cwd, a
few environment variables, the names of all of them, the prompt, the session id, the pid); the
API key is logged only as present or absent, never its value.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from typing import Any, NoReturn

# Kept lean on purpose (no pathlib, dataclasses, subprocess at import time): the fake is started
# hundreds of times per test run and must answer quickly.

VERSION = "0.0.0-fake"
DEFAULT_MODEL = "claude-opus-4-5"
DEFAULT_TOOLS = ["Task", "Bash", "Glob", "Grep", "Read", "Edit", "Write", "NotebookEdit",
                 "WebFetch", "WebSearch", "TodoWrite"]
OUTPUT_FORMATS = ("text", "json", "stream-json")
PERMISSION_MODES = ("acceptEdits", "auto", "bypassPermissions", "manual", "dontAsk", "plan",
                    "default")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
CONTEXT_WINDOW = 200000
MAX_OUTPUT_TOKENS = 32000

# Flag name -> (canonical key, arity).  Arity 0: a switch; 1: one value; "*": commander-style
# variadic (one value, then every following argument that does not start with '-').
FLAGS: dict[str, tuple[str, Any]] = {
    "-p": ("print", 0), "--print": ("print", 0),
    "--verbose": ("verbose", 0),
    "--strict-mcp-config": ("strict_mcp_config", 0),
    "--fork-session": ("fork_session", 0),
    "-v": ("version", 0), "--version": ("version", 0),
    "-h": ("help", 0), "--help": ("help", 0),
    "--output-format": ("output_format", 1),
    "--model": ("model", 1),
    "--effort": ("effort", 1),
    "--permission-mode": ("permission_mode", 1),
    "--append-system-prompt-file": ("append_system_prompt_file", 1),
    "--session-id": ("session_id", 1),
    "-r": ("resume", 1), "--resume": ("resume", 1),
    "--max-budget-usd": ("max_budget_usd", 1),
    "--max-turns": ("max_turns", 1),
    "--tools": ("tools", "*"),
    "--allowedTools": ("allowed_tools", "*"), "--allowed-tools": ("allowed_tools", "*"),
    "--disallowedTools": ("disallowed_tools", "*"), "--disallowed-tools": ("disallowed_tools", "*"),
    "--mcp-config": ("mcp_config", "*"),
}
# How the real CLI names each value-taking option in its error messages.
FLAG_LABELS = {
    "output_format": "--output-format <format>", "model": "--model <model>",
    "effort": "--effort <level>", "permission_mode": "--permission-mode <mode>",
    "append_system_prompt_file": "--append-system-prompt-file <file>",
    "session_id": "--session-id <uuid>", "resume": "-r, --resume [value]",
    "max_budget_usd": "--max-budget-usd <amount>", "max_turns": "--max-turns <turns>",
    "tools": "--tools <tools...>", "allowed_tools": "--allowedTools, --allowed-tools <tools...>",
    "disallowed_tools": "--disallowedTools, --disallowed-tools <tools...>",
    "mcp_config": "--mcp-config <configs...>",
}

# Directive name -> kind of value.  "flag": no value; "float"/"int"/"str": one value;
# "list": repeatable, every occurrence kept in order.
DIRECTIVES: dict[str, str] = {
    "cost": "float", "tokens": "str", "cc1h": "int", "turns": "int", "tool_uses": "int",
    "tool_delay": "float", "split": "flag", "sleep": "float", "hang": "flag", "crash": "flag",
    "exit": "int", "malformed": "flag", "model": "str", "api_error": "str",
    "is_error_exit0": "flag", "double_result": "flag", "child": "float", "child_pidfile": "str",
    "write": "list", "budget_exceed": "flag", "stderr": "list", "tool": "list", "text": "str",
    "remap": "str", "deny": "list", "raw": "list", "result_splice": "str",
    "escape": "float", "escape_pidfile": "str",
}
DENIED = "<denied>"  # marks a tool call a permission rule refuses
API_ERROR_KINDS = ("429", "529", "prompt_too_long", "500", "auth")
DIRECTIVE_RE = re.compile(r"^\s*FAKE:\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:=(.*))?$")
UUID_RE = re.compile(r"^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")
LOGGED_ENV = ("ANTHROPIC_BASE_URL", "AGENTBENCH_CHILD", "DISABLE_AUTOUPDATER", "VIRTUAL_ENV",
              "CLAUDECODE", "PATH")


class CliError(Exception):
    """A launch error: message to stderr, exit with `code` (1, as the real CLI does)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def parse_argv(argv: list[str]) -> dict[str, Any]:
    """Parse the launch flags as the real CLI's option parser does, as far as agentbench uses them.

    Returns a dict keyed by canonical option name; positional words are kept under "positional".
    Raises CliError for an unknown option or a missing value (the real CLI exits 1 for both).
    """
    opts: dict[str, Any] = {"positional": []}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            opts["positional"].extend(argv[i:])
            break
        if not arg.startswith("-") or arg == "-":
            opts["positional"].append(arg)
            continue
        name, eq, inline = arg.partition("=")
        if name not in FLAGS:
            raise CliError(f"error: unknown option '{name}'")
        key, arity = FLAGS[name]
        if arity == 0:
            if eq:
                raise CliError(f"error: option '{name}' does not take a value")
            opts[key] = True
            continue
        if eq:
            values = [inline]
        elif i < len(argv):
            values = [argv[i]]
            i += 1
        else:
            raise CliError(f"error: option '{FLAG_LABELS.get(key, name)}' argument missing")
        if arity == "*":
            if not eq:
                while i < len(argv) and not argv[i].startswith("-"):
                    values.append(argv[i])
                    i += 1
            opts.setdefault(key, []).extend(values)
        else:
            opts[key] = values[0]
    return opts


def validate(opts: dict[str, Any], env: dict[str, str]) -> None:
    """Refuse what the real CLI refuses before it starts a session (same messages, exit 1)."""
    for key, choices in (("output_format", OUTPUT_FORMATS), ("permission_mode", PERMISSION_MODES)):
        val = opts.get(key)
        if val is not None and val not in choices:
            allowed = ", ".join(c for c in choices if c != "default")
            raise CliError(f"error: option '{FLAG_LABELS[key]}' argument '{val}' is invalid. "
                           f"Allowed choices are {allowed}.")
    if "max_turns" in opts:
        try:
            opts["max_turns"] = int(opts["max_turns"])
        except ValueError:
            raise CliError(f"error: option '{FLAG_LABELS['max_turns']}' argument "
                           f"'{opts['max_turns']}' is invalid. must be a number") from None
    if "max_budget_usd" in opts:
        raw = opts["max_budget_usd"]
        try:
            budget = float(raw)
        except ValueError:
            budget = -1.0
        if not budget > 0:
            raise CliError(f"error: option '{FLAG_LABELS['max_budget_usd']}' argument '{raw}' is "
                           f"invalid. --max-budget-usd must be a number greater than 0")
        opts["max_budget_usd_value"] = budget
    if not opts.get("print"):
        raise CliError("fake claude: only non-interactive --print mode is supported")
    if opts.get("output_format") != "stream-json":
        raise CliError("fake claude: only --output-format stream-json is supported")
    if not opts.get("verbose"):
        raise CliError("Error: When using --print, --output-format=stream-json requires --verbose")
    effort = opts.get("effort")
    if effort is not None and effort not in EFFORTS:
        # The real CLI warns and carries on with its default effort.
        err(f"Warning: Unknown --effort value '{effort}' — ignoring it and using the "
            f"default effort. Valid values: {', '.join(EFFORTS)}.")
    if (opts.get("permission_mode") == "bypassPermissions" and _is_root()
            and env.get("IS_SANDBOX") != "1"):
        raise CliError("--dangerously-skip-permissions cannot be used with root/sudo privileges "
                       "for security reasons")
    spf = opts.get("append_system_prompt_file")
    if spf is not None and not os.path.isfile(spf):
        raise CliError(f"Error: Append system prompt file not found: {spf}")
    for cfg in opts.get("mcp_config", []):
        problem = _mcp_config_problem(cfg)
        if problem:
            raise CliError(f"Error: Invalid MCP configuration:\n{problem}")
    sid = opts.get("session_id")
    if sid is not None and not UUID_RE.match(sid):
        raise CliError("Error: Invalid session ID. Must be a valid UUID.")
    if sid is not None and opts.get("resume") is not None and not opts.get("fork_session"):
        raise CliError("Error: --session-id with --continue or --resume also needs --fork-session.")


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _mcp_config_problem(cfg: str) -> str | None:
    """None if `cfg` is a JSON object or a readable file holding one, else why not."""
    text = cfg
    if not cfg.lstrip().startswith("{"):
        if not os.path.isfile(cfg):
            return f"MCP config file not found: {cfg}"
        with open(cfg, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    try:
        data = json.loads(text)
    except ValueError:
        return f"MCP config is not valid JSON: {cfg}"
    if not isinstance(data, dict):
        return f"MCP config must be a JSON object: {cfg}"
    return None


def tools_list(opts: dict[str, Any]) -> list[str]:
    """The tool names the init event reports: --tools as given ("" for none, "default" for all)."""
    if "tools" not in opts:
        return list(DEFAULT_TOOLS)
    names: list[str] = []
    for value in opts["tools"]:
        for part in re.split(r"[,\s]+", value):
            if part == "default":
                names.extend(t for t in DEFAULT_TOOLS if t not in names)
            elif part and part not in names:
                names.append(part)
    return names


# ------------------------------------------------------------------------------------------------
# Directives
# --------------------------------------------------------------------------------------------------

class Plan:
    """What this call does, from the prompt's FAKE directives (default: a one-message success)."""

    def __init__(self) -> None:
        self.cost: float = 0.01
        # input, output, cache creation, cache read
        self.tokens: tuple[int, int, int, int] = (100, 50, 0, 0)
        self.cc1h: int = 0
        self.turns: int | None = None
        self.tool_uses: int = 0
        self.tool_delay: float = 0.0
        self.split: bool = False
        self.sleep: float = 0.0
        self.hang: bool = False
        self.crash: bool = False
        self.exit: int | None = None
        self.malformed: bool = False
        self.model: str | None = None
        self.remap: str | None = None
        self.api_error: str | None = None
        self.is_error_exit0: bool = False
        self.double_result: bool = False
        self.child: float | None = None
        self.child_pidfile: str | None = None
        self.write: list[str] = []
        self.budget_exceed: bool = False
        self.stderr: list[str] = []
        self.tool: list[str] = []
        self.deny: list[str] = []
        self.tool_calls: list[tuple[str, dict[str, Any]]] = []  # parsed from `tool`
        self.text: str = "Done."
        # Hostile-stream tests: lines printed verbatim after the init event, and JSON members
        # spliced verbatim into every result line (later members win: `"total_cost_usd": NaN`).
        self.raw: list[str] = []
        # A process that escapes the session: double fork + setsid, its parent gone at once.
        self.escape: float | None = None
        self.escape_pidfile: str | None = None
        self.result_splice: str | None = None


def parse_directives(prompt: str) -> Plan:
    """Read `FAKE: key=value` lines from the prompt into a Plan; CliError(code 2) on a bad one."""
    plan = Plan()
    for line in prompt.splitlines():
        m = DIRECTIVE_RE.match(line)
        if not m:
            continue
        key, value = m.group(1), m.group(2)
        kind = DIRECTIVES.get(key)
        if kind is None:
            raise CliError(f"fake claude: unknown directive {key!r}", code=2)
        if kind == "flag":
            if value is not None:
                raise CliError(f"fake claude: directive {key!r} takes no value", code=2)
            setattr(plan, key, True)
            continue
        if value is None:
            raise CliError(f"fake claude: directive {key!r} needs a value", code=2)
        value = value.strip()
        try:
            if kind == "float":
                setattr(plan, key, float(value))
            elif kind == "int":
                setattr(plan, key, int(value))
            elif kind == "list":
                getattr(plan, key).append(value)
            elif key == "tokens":
                parts = [int(p) for p in value.split(",")]
                if len(parts) != 4 or min(parts) < 0:
                    raise ValueError(value)
                plan.tokens = (parts[0], parts[1], parts[2], parts[3])
            else:
                setattr(plan, key, value)
        except ValueError:
            raise CliError(f"fake claude: bad value for directive {key!r}: {value!r}",
                           code=2) from None
    for spec in plan.tool:
        name, _, raw_input = spec.partition(" ")
        try:
            tool_input = json.loads(raw_input) if raw_input.strip() else {}
        except ValueError:
            tool_input = None
        if not name or not isinstance(tool_input, dict):
            raise CliError(f"fake claude: tool needs NAME JSON-OBJECT, got {spec!r}", code=2)
        plan.tool_calls.append((name, tool_input))
    for spec in plan.write:
        rel, sep, _ = spec.partition(":")
        if not sep or not rel:
            raise CliError(f"fake claude: write needs REL:CONTENT, got {spec!r}", code=2)
    if plan.api_error is not None and plan.api_error not in API_ERROR_KINDS:
        raise CliError(f"fake claude: api_error must be one of {', '.join(API_ERROR_KINDS)}",
                       code=2)
    if plan.cc1h > plan.tokens[2]:
        raise CliError("fake claude: cc1h exceeds the cache creation tokens", code=2)
    return plan


# ------------------------------------------------------------------------------------------------
# Transcripts and running totals
# --------------------------------------------------------------------------------------------------

def config_dir(env: dict[str, str]) -> str:
    return env.get("CLAUDE_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".claude")


def transcript_path(env: dict[str, str], cwd: str, session_id: str) -> str:
    """Where the real binary keeps a session: projects/<cwd, non-alnum as '-'>/<id>.jsonl."""
    return os.path.join(config_dir(env), "projects", re.sub(r"[^A-Za-z0-9]", "-", cwd),
                        f"{session_id}.jsonl")


def empty_totals() -> dict[str, Any]:
    return {"totalCostUSD": 0.0, "modelUsage": {}}


def read_totals(path: str) -> tuple[dict[str, Any], str | None]:
    """The session's running totals (its transcript's last `cost-state` line; zero if none) and the
    uuid of its last message, which the next prompt line links to."""
    totals = empty_totals()
    leaf = None
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return totals, leaf
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a torn line from a killed process
        if not isinstance(obj, dict):
            continue
        if obj.get("type") == "cost-state":
            totals = {"totalCostUSD": float(obj.get("totalCostUSD") or 0.0),
                      "modelUsage": dict(obj.get("modelUsage") or {})}
        elif obj.get("type") in ("user", "assistant") and obj.get("uuid"):
            leaf = obj["uuid"]
    return totals, leaf


def out(line: str) -> None:
    """One line to stdout as UTF-8 whatever the locale, flushed at once (readers go by line)."""
    sys.stdout.buffer.write(line.encode("utf-8") + b"\n")
    sys.stdout.buffer.flush()


def err(line: str) -> None:
    """One line to stderr as UTF-8 whatever the locale."""
    sys.stderr.buffer.write(line.encode("utf-8") + b"\n")
    sys.stderr.buffer.flush()


def dumps(obj: Any) -> str:
    """Compact JSON with raw UTF-8, as the real binary's JSON.stringify writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class Transcript:
    """Appends the session's lines: the prompt, every assistant/user event, the final cost-state."""

    def __init__(self, path: str, session_id: str, cwd: str, parent: str | None):
        self.path = path
        self.session_id = session_id
        self.cwd = cwd
        self.parent = parent
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def append(self, obj: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(dumps(obj) + "\n")

    def message(self, event: dict[str, Any], **extra: Any) -> None:
        """Record a user or assistant message with the envelope fields real transcripts carry."""
        line = {"parentUuid": self.parent, "isSidechain": False, "type": event["type"],
                "message": event["message"], "uuid": event.get("uuid") or str(uuid.uuid4()),
                "timestamp": now_iso(), "userType": "external", "entrypoint": "sdk-cli",
                "cwd": self.cwd, "sessionId": self.session_id, "version": VERSION, **extra}
        self.parent = line["uuid"]
        self.append(line)

    def cost_state(self, totals: dict[str, Any]) -> None:
        self.append({"type": "cost-state", "sessionId": self.session_id,
                     "totalCostUSD": totals["totalCostUSD"], "modelUsage": totals["modelUsage"]})


def fork_transcript(src: str, dst: str, new_id: str) -> None:
    """Start `new_id` with `src`'s history (and so its saved totals), as --fork-session does."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    out = []
    with open(src, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "sessionId" in obj:
            obj["sessionId"] = new_id
        out.append(dumps(obj))
    with open(dst, "w", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in out))


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


# ------------------------------------------------------------------------------------------------
# Usage arithmetic
# --------------------------------------------------------------------------------------------------

def split_int(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` ints summing to it; the first part takes the remainder."""
    base, rem = divmod(total, parts)
    return [base + (rem if i == 0 else 0) for i in range(parts)]


def msg_usage(inp: int, outp: int, cc: int, cr: int, cc1h: int) -> dict[str, Any]:
    """One API response's usage block, as it appears on an assistant event."""
    return {"input_tokens": inp, "cache_creation_input_tokens": cc, "cache_read_input_tokens": cr,
            "output_tokens": outp,
            "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
            "service_tier": "standard",
            "cache_creation": {"ephemeral_1h_input_tokens": cc1h,
                               "ephemeral_5m_input_tokens": cc - cc1h}}


def add_model_usage(mu: dict[str, Any], model: str, u: dict[str, Any], cost: float) -> None:
    """Add one API response's tokens and cost to a modelUsage map (in place), real field set."""
    e = mu.setdefault(model, {})
    for k in ("inputTokens", "outputTokens", "cacheReadInputTokens", "cacheCreationInputTokens",
              "cacheCreationEphemeral5mInputTokens", "cacheCreationEphemeral1hInputTokens",
              "webSearchRequests", "thinkingTokens"):
        e.setdefault(k, 0)
    e.setdefault("costUSD", 0.0)
    e["inputTokens"] += u["input_tokens"]
    e["outputTokens"] += u["output_tokens"]
    e["cacheReadInputTokens"] += u["cache_read_input_tokens"]
    e["cacheCreationInputTokens"] += u["cache_creation_input_tokens"]
    e["cacheCreationEphemeral5mInputTokens"] += u["cache_creation"]["ephemeral_5m_input_tokens"]
    e["cacheCreationEphemeral1hInputTokens"] += u["cache_creation"]["ephemeral_1h_input_tokens"]
    e["costUSD"] = round(e["costUSD"] + cost, 10)
    e.update({"contextWindow": CONTEXT_WINDOW, "maxOutputTokens": MAX_OUTPUT_TOKENS,
              "canonicalModel": model, "provider": "firstParty", "costBasis": "list"})


def usage_from_model_usage(mu: dict[str, Any]) -> dict[str, Any]:
    """A result's `usage` block: the token sums over a modelUsage map."""
    def total(k: str) -> int:
        return sum(int(v.get(k, 0)) for v in mu.values())
    return {"input_tokens": total("inputTokens"),
            "cache_creation_input_tokens": total("cacheCreationInputTokens"),
            "cache_read_input_tokens": total("cacheReadInputTokens"),
            "output_tokens": total("outputTokens"),
            "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
            "service_tier": "standard",
            "cache_creation": {
                "ephemeral_1h_input_tokens": total("cacheCreationEphemeral1hInputTokens"),
                "ephemeral_5m_input_tokens": total("cacheCreationEphemeral5mInputTokens")}}


def copy_json(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def js_number(x: float) -> str:
    """Format a number the way JavaScript prints it (2, 0.5, 0.0001)."""
    if float(x).is_integer():
        return str(int(x))
    text = repr(float(x))
    if "e" in text:  # JavaScript writes plain decimals down to 1e-7
        text = f"{x:.12f}".rstrip("0")
    return text


# ------------------------------------------------------------------------------------------------
# The session
# --------------------------------------------------------------------------------------------------

class Session:
    """One invocation: emits the stream, keeps the transcript, accounts for this call's usage.

    Three usage ledgers, as the real binary keeps them: `model_usage` is cumulative over the
    session lineage (restored from the transcript; reported as `modelUsage`), `proc_usage` is this
    process's own (reported as `usage`), `since_last` is what this process counted since its
    previous result (reported as `model_usage_since_last_result`).
    """

    def __init__(self, opts: dict[str, Any], plan: Plan, env: dict[str, str], session_id: str,
                 transcript: Transcript, totals: dict[str, Any]):
        self.opts = opts
        self.plan = plan
        self.env = env
        self.session_id = session_id
        self.transcript = transcript
        self.start = time.monotonic()
        self.requested_model = opts.get("model") or DEFAULT_MODEL
        # The binary's own alias remap changes the model everywhere; a response that reports
        # another model (`model=`) shows only on the assistant events: modelUsage stays keyed by
        # the requested model.
        self.session_model = plan.remap or self.requested_model
        self.response_model = plan.model or self.session_model
        self.prior_cost = float(totals["totalCostUSD"])
        self.model_usage: dict[str, Any] = copy_json(totals["modelUsage"])
        self.proc_usage: dict[str, Any] = {}
        self.since_last: dict[str, Any] = {}
        self.call_cost = 0.0
        self.result_index = 0
        self.api_ms = 0
        self.denials: list[dict[str, Any]] = []

    # -- events ------------------------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        line = dumps(event)
        if event.get("type") == "result" and self.plan.result_splice:
            line = line[:-1] + "," + self.plan.result_splice + "}"
        out(line)

    def init_event(self) -> dict[str, Any]:
        cwd = self.transcript.cwd
        return {"type": "system", "subtype": "init", "cwd": cwd, "session_id": self.session_id,
                "tools": tools_list(self.opts), "mcp_servers": [], "model": self.session_model,
                "permissionMode": self.opts.get("permission_mode") or "default",
                "slash_commands": [], "terminal_slash_commands": [],
                "apiKeySource": ("ANTHROPIC_API_KEY" if self.env.get("ANTHROPIC_API_KEY")
                                 else "none"),
                "claude_code_version": VERSION, "output_style": "default", "agents": [],
                "skills": [],
                "plugins": [], "capabilities": [], "analytics_disabled": False,
                "product_feedback_disabled": False, "served_by_anthropic": True,
                "uuid": str(uuid.uuid4()), "sandbox_enabled": False,
                "memory_paths": {"auto": os.path.join(os.path.dirname(self.transcript.path),
                                                      "memory", "")},
                "original_cwd": cwd, "additional_directories": [], "fast_mode_state": "off"}

    def assistant(self, msg_id: str, content: list[dict[str, Any]], usage: dict[str, Any],
                  model: str, **extra: Any) -> dict[str, Any]:
        event = {"type": "assistant",
                 "message": {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                             "content": content, "stop_reason": None, "stop_sequence": None,
                             "usage": usage},
                 "parent_tool_use_id": None, "session_id": self.session_id,
                 "uuid": str(uuid.uuid4())}
        event.update(extra)
        return event

    def user_tool_result(self, tool_use_id: str, name: str, text: str,
                         denied: bool = False) -> dict[str, Any]:
        event: dict[str, Any] = {
            "type": "user",
            "message": {"role": "user",
                        "content": [{"tool_use_id": tool_use_id, "type": "tool_result",
                                     "content": text, "is_error": denied}]},
            "parent_tool_use_id": None, "session_id": self.session_id, "uuid": str(uuid.uuid4())}
        if denied:
            event["tool_result_meta"] = [{"non_execution_kind": "permission-rule",
                                          "permission_decision": {"decision": "reject",
                                                                  "source": "config"}}]
        elif name == "Bash":
            event["tool_use_result"] = {"stdout": text, "stderr": "", "interrupted": False,
                                        "isImage": False}
        return event

    def response(self, content: list[dict[str, Any]], usage: dict[str, Any], cost: float) -> None:
        """Emit one API response and count it once.

        Under `split` it comes as 3 events sharing message.id, one content block each, every one
        carrying the same early usage snapshot (output_tokens below the final count), as the real
        binary streams it; the final count reaches only the result's usage.
        """
        msg_id = "msg_fake_" + uuid.uuid4().hex[:24]
        request_id = "req_fake_" + uuid.uuid4().hex[:24]
        if self.plan.split:
            fillers = [{"type": "text", "text": f"(part {i + 1})"} for i in range(3 - len(content))]
            snapshot = dict(usage, output_tokens=usage["output_tokens"] // 4)
            pieces = [([block], snapshot) for block in fillers + list(content)]
        else:
            pieces = [(content, usage)]
        for blocks, shown in pieces:
            ev = self.assistant(msg_id, blocks, shown, self.response_model)
            self.emit(ev)
            self.transcript.message(ev, requestId=request_id, requestedModel=self.session_model)
        for ledger in (self.model_usage, self.proc_usage, self.since_last):
            add_model_usage(ledger, self.session_model, usage, cost)
        self.call_cost += cost
        self.api_ms += 1

    def result(self, *, subtype: str, is_error: bool, terminal_reason: str, num_turns: int,
               stop_reason: str | None, **extra: Any) -> dict[str, Any]:
        """A result event with the real binary's fields: cumulative total_cost_usd and modelUsage,
        per-call usage, the delta since the previous result; then the ledger of deltas restarts."""
        ev: dict[str, Any] = {
            "type": "result", "subtype": subtype, "is_error": is_error,
            "duration_ms": int((time.monotonic() - self.start) * 1000),
            "duration_api_ms": self.api_ms,
            "num_turns": num_turns, "stop_reason": stop_reason, "session_id": self.session_id,
            "total_cost_usd": round(self.prior_cost + self.call_cost, 10),
            "usage": usage_from_model_usage(self.proc_usage),
            "modelUsage": copy_json(self.model_usage),
            "model_usage_since_last_result": copy_json(self.since_last),
            "permission_denials": copy_json(self.denials),
            "terminal_reason": terminal_reason}
        ev.update(extra)
        ev["uuid"] = str(uuid.uuid4())
        ev["result_index"] = self.result_index
        self.result_index += 1
        self.since_last = {}
        return ev

    def success(self, num_turns: int, text: str, is_error: bool = False) -> dict[str, Any]:
        return self.result(subtype="success", is_error=is_error, terminal_reason="completed",
                           num_turns=num_turns, stop_reason="end_turn", api_error_status=None,
                           result=text)

    def save_totals(self) -> None:
        """Write the running totals to the transcript (what a later resume or fork starts from)."""
        self.transcript.cost_state({"totalCostUSD": round(self.prior_cost + self.call_cost, 10),
                                    "modelUsage": self.model_usage})


def run_session(s: Session) -> int:
    """Play the plan out on stdout; returns the exit code."""
    plan = s.plan
    for line in plan.stderr:
        err(line)
    for spec in plan.write:
        rel, _, content = spec.partition(":")
        target = os.path.join(s.transcript.cwd, rel)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        # "\n" in the directive stands for a newline, so multi-line files fit on one line.
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(content.replace("\\n", "\n"))
    if plan.child is not None:
        start_child(plan.child, plan.child_pidfile)
    if plan.escape is not None:
        start_escaped(plan.escape, plan.escape_pidfile)

    s.emit(s.init_event())
    for line in plan.raw:
        out(line)
    if plan.hang:
        while True:  # silent until killed, like a wedged session
            time.sleep(3600)
    if plan.malformed:
        out("this line is not JSON {")

    # The tool calls of this call: explicit `tool=` ones first, then denied Bash commands, then
    # `tool_uses` Bash echoes.
    calls: list[tuple[str, dict[str, Any], str]] = [(n, i, "ok") for n, i in plan.tool_calls]
    for cmd in plan.deny:
        calls.append(("Bash", {"command": cmd}, DENIED))
    for i in range(plan.tool_uses):
        calls.append(("Bash", {"command": f"echo {i}", "description": f"Print {i}"}, f"{i}"))

    max_turns = s.opts.get("max_turns")
    over_turns = max_turns is not None and max(plan.turns or 0, len(calls) + 1) > max_turns
    if over_turns:
        # The model keeps calling tools until the limit: one tool round per allowed turn.
        while len(calls) < max_turns:
            calls.append(("Bash", {"command": f"echo {len(calls)}"}, f"{len(calls)}"))
        calls = calls[:max(max_turns, 0)]
    # API responses that cost something: one per tool round, plus the final answer (an API error
    # answer is synthetic and free).
    n_paid = max(len(calls) + (0 if over_turns or plan.api_error else 1), 1)
    parts = [split_int(x, n_paid) for x in (*plan.tokens, plan.cc1h)]
    costs = [plan.cost / n_paid] * n_paid

    def usage_at(k: int) -> dict[str, Any]:
        return msg_usage(parts[0][k], parts[1][k], parts[2][k], parts[3][k], parts[4][k])

    budget = s.opts.get("max_budget_usd_value")

    def budget_hit() -> bool:
        # Checked after each response, before its tools run; like the real binary,
        # --max-budget-usd counts only what this process spent, not the restored total.
        return plan.budget_exceed or (budget is not None and not s.call_cost < budget)

    unknown = {"type": "fake_unknown_event", "subtype": "whatever", "session_id": s.session_id}
    for k, (name, tool_input, output) in enumerate(calls):
        tool_id = "toolu_fake_" + uuid.uuid4().hex[:20]
        s.response([{"type": "tool_use", "id": tool_id, "name": name, "input": tool_input}],
                   usage_at(k), costs[k])
        if plan.crash:
            return crash()
        if plan.malformed and k == 0:
            s.emit(dict(unknown, uuid=str(uuid.uuid4())))
        if budget_hit():
            return finish_budget(s, budget, k + 1, "tool_use")
        if plan.tool_delay:
            time.sleep(plan.tool_delay)
        if output == DENIED:
            # A permission rule refused it: an error tool_result, listed in permission_denials;
            # the session goes on.
            cmd = tool_input.get("command", "")
            ev = s.user_tool_result(tool_id, name, f"Permission to use {name} with command {cmd} "
                                    "has been denied.", denied=True)
            s.denials.append({"tool_name": name, "tool_use_id": tool_id, "tool_input": tool_input})
        else:
            ev = s.user_tool_result(tool_id, name, output)
        s.emit(ev)
        s.transcript.message(ev)

    if over_turns:
        ev = s.result(subtype="error_max_turns", is_error=True, terminal_reason="max_turns",
                      num_turns=max_turns + 1, stop_reason="tool_use",
                      errors=[f"Reached maximum number of turns ({max_turns})"])
        return finish(s, [ev], 1)
    if plan.api_error is not None:
        return finish_api_error(s, len(calls) + 1)

    num_turns = plan.turns if plan.turns is not None else len(calls) + 1
    if plan.double_result:
        # An early result with the totals so far; the last result printed holds the true ones.
        s.emit(s.success(num_turns, "(interim)"))
    k = len(calls)
    s.response([{"type": "text", "text": plan.text}], usage_at(k), costs[k])
    if plan.crash:
        return crash()
    if plan.malformed and not calls:
        s.emit(dict(unknown, uuid=str(uuid.uuid4())))
    if budget_hit():
        return finish_budget(s, budget, k + 1, "end_turn")
    if plan.sleep:
        time.sleep(plan.sleep)
    if plan.malformed:
        out('{"type":"assistant","message":{"id":"msg_truncated","content":[{"type":"te')
    final = s.success(num_turns, plan.text, is_error=plan.is_error_exit0)
    return finish(s, [final], plan.exit if plan.exit is not None else 0)


def finish(s: Session, results: list[dict[str, Any]], code: int) -> int:
    """Print the result event(s), save the running totals, return the exit code."""
    for ev in results:
        s.emit(ev)
    s.save_totals()
    return code


def finish_budget(s: Session, budget: float | None, turns: int, stop_reason: str) -> int:
    """The --max-budget-usd stop (the limit named is the flag's value, else this call's cost)."""
    limit = budget if budget is not None else s.plan.cost
    ev = s.result(subtype="error_max_budget_usd", is_error=True, terminal_reason="budget_exhausted",
                  num_turns=turns, stop_reason=stop_reason,
                  errors=[f"Reached maximum budget (${js_number(limit)})"])
    return finish(s, [ev], 1)


# kind -> (HTTP status, api_error_type, the assistant event's `error`, text)
API_ERRORS: dict[str, tuple[int, str, str, str]] = {
    "429": (429, "rate_limit_error", "rate_limit",
            "API Error: Request rejected (429) · Number of request tokens has exceeded your "
            "per-minute rate limit"),
    "529": (529, "overloaded_error", "overloaded",
            "API Error: 529 Overloaded. This is a server-side issue, usually temporary — "
            "try again in a moment."),
    "500": (500, "api_error", "server_error",
            "API Error: 500 Internal server error. This is a server-side issue, usually "
            "temporary — try again in a moment."),
    "prompt_too_long": (400, "invalid_request_error", "invalid_request",
                        "Prompt is too long · the request is ~250000 tokens (limit 200000)"),
    "auth": (401, "authentication_error", "authentication_failed",
             "Invalid API key · Fix external API key"),
}


def finish_api_error(s: Session, turns: int) -> int:
    """An API error as the real binary reports it: a synthetic zero-usage assistant message with the
    error text, then a result with subtype `success`, `is_error: true`, the HTTP status in
    `api_error_status`; exit 1 (`is_error_exit0` makes it 0)."""
    status, error_type, error, text = API_ERRORS[s.plan.api_error or "500"]
    ev = s.assistant(str(uuid.uuid4()), [{"type": "text", "text": text}], msg_usage(0, 0, 0, 0, 0),
                     "<synthetic>", error=error, request_id="req_fake_" + uuid.uuid4().hex[:24],
                     is_api_error_message=True, api_error_status=status,
                     api_error_type=error_type)
    ev["message"]["stop_reason"] = "stop_sequence"
    ev["message"]["stop_sequence"] = ""
    s.emit(ev)
    s.transcript.message(ev)
    reason = "prompt_too_long" if s.plan.api_error == "prompt_too_long" else "api_error"
    res = s.result(subtype="success", is_error=True, terminal_reason=reason, num_turns=turns,
                   stop_reason="stop_sequence", api_error_status=status, api_error_type=error_type,
                   result=text)
    return finish(s, [res], 0 if s.plan.is_error_exit0 else 1)


def crash() -> int:
    """Die without a result and without saving totals, like a process that crashed."""
    err("fake claude: simulated crash")
    return 3


def start_child(seconds: float, pidfile: str | None) -> None:
    """Leave a grandchild behind: same session and process group, stdio on /dev/null."""
    import subprocess  # only this directive needs it; keep the common path's start-up short

    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds!r})"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)
    if pidfile:
        tmp = pidfile + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{proc.pid}\n")
        os.replace(tmp, pidfile)


def start_escaped(seconds: float, pidfile: str | None) -> None:
    """Leave a process that escapes the tree: a double fork whose grandchild makes its own session
    (setsid) and whose middle process exits at once, so the grandchild is orphaned (adopted by
    init, or by the nearest child subreaper)."""
    middle = os.fork()
    if middle == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                fd = os.open(os.devnull, os.O_RDWR)
                for std in (0, 1, 2):
                    os.dup2(fd, std)
                if pidfile:
                    with open(pidfile + ".tmp", "w", encoding="utf-8") as fh:
                        fh.write(f"{os.getpid()}\n")
                    os.replace(pidfile + ".tmp", pidfile)
                time.sleep(seconds)
        finally:
            os._exit(0)
    os.waitpid(middle, 0)
    if pidfile:
        deadline = time.monotonic() + 10
        while not os.path.exists(pidfile) and time.monotonic() < deadline:
            time.sleep(0.01)


# ------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def log_invocation(env: dict[str, str], argv: list[str], cwd: str, prompt: str | None,
                   session_id: str | None) -> None:
    """Append this call to $FAKE_CLAUDE_LOG (the API key only as present/absent)."""
    path = env.get("FAKE_CLAUDE_LOG")
    if not path:
        return
    rec_env: dict[str, Any] = {"ANTHROPIC_API_KEY": "ANTHROPIC_API_KEY" in env}
    for k in LOGGED_ENV:
        rec_env[k] = env.get(k)
    # Names only (never values) of everything in the environment, so env-scrub tests can check
    # what reached the binary.
    rec = {"argv": argv, "cwd": cwd, "env": rec_env, "env_names": sorted(env), "prompt": prompt,
           "session_id": session_id, "pid": os.getpid()}
    # One write on an O_APPEND descriptor: concurrent fakes never interleave within a line.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (dumps(rec) + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def fail(message: str, code: int) -> NoReturn:
    err(message)
    sys.exit(code)


def no_conversation(session_id: str, start: float) -> dict[str, Any]:
    """The result the real binary prints for --resume of an unknown session (no init before it)."""
    return {"type": "result", "subtype": "error_during_execution",
            "duration_ms": int((time.monotonic() - start) * 1000), "duration_api_ms": 0,
            "is_error": True, "num_turns": 0, "stop_reason": None, "session_id": session_id,
            "total_cost_usd": 0, "usage": usage_from_model_usage({}), "modelUsage": {},
            "permission_denials": [], "uuid": str(uuid.uuid4()),
            "errors": [f"No conversation found with session ID: {session_id}"], "result_index": 0}


def main(argv: list[str]) -> int:
    start = time.monotonic()
    env = dict(os.environ)
    cwd = os.getcwd()
    try:
        opts = parse_argv(argv)
        if opts.get("version"):
            log_invocation(env, argv, cwd, None, None)
            out(f"{VERSION} (Claude Code)")
            return 0
        if opts.get("help"):
            out("Usage: claude -p --output-format stream-json --verbose [options]  (fake)")
            return 0
        validate(opts, env)
    except CliError as exc:
        log_invocation(env, argv, cwd, None, None)
        fail(str(exc), exc.code)

    # Until EOF: an open stdin blocks here, as it can stall the real binary.
    prompt = sys.stdin.buffer.read().decode("utf-8", "replace")
    if opts["positional"]:
        prompt = (prompt + "\n" if prompt else "") + " ".join(opts["positional"])
    try:
        plan = parse_directives(prompt)
    except CliError as exc:
        log_invocation(env, argv, cwd, prompt, None)
        fail(str(exc), exc.code)

    resume = opts.get("resume")
    fork = bool(opts.get("fork_session")) and resume is not None
    session_id = opts.get("session_id") if (fork or resume is None) else resume
    session_id = session_id or str(uuid.uuid4())
    log_invocation(env, argv, cwd, prompt, session_id)

    path = transcript_path(env, cwd, session_id)
    if resume is not None:
        src = transcript_path(env, cwd, resume)
        if not os.path.isfile(src):
            out(dumps(no_conversation(resume, start)))
            fail(f"No conversation found with session ID: {resume}", 1)
        if fork:
            if os.path.exists(path):
                fail(f"Error: Session ID {session_id} is already in use.", 1)
            fork_transcript(src, path, session_id)
    elif os.path.exists(path):
        fail(f"Error: Session ID {session_id} is already in use.", 1)

    totals, leaf = read_totals(path)
    transcript = Transcript(path, session_id, cwd, leaf)
    transcript.message({"type": "user", "message": {"role": "user", "content": prompt}})
    session = Session(opts, plan, env, session_id, transcript, totals)
    try:
        return run_session(session)
    except BrokenPipeError:  # the reader went away (a killed supervisor): nothing left to say
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
