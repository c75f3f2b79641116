"""Read the JSON config files as CANN's documents write them.

The published examples carry `//` comments, trailing commas and, in one policy example, a missing
comma between two members. Each is repaired before `json.loads`; anything else is an error that
names the file, line and column.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tessel.config.errors import ConfigError

log = logging.getLogger(__name__)

_VALUE_END = set('"}]0123456789el')  # last char of a string, object, array, number, true/false/null


def _normalise(text: str) -> tuple[str, int]:
    """Drop comments and trailing commas; add a comma between a value and a key that starts the
    next line. Returns the text and how many commas were repaired."""
    out: list[str] = []
    repairs = 0
    i, n, in_str = 0, len(text), False
    last_sig = ""  # last significant character outside strings
    newline_since = False
    while i < n:
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
                last_sig, newline_since = '"', False
            i += 1
            continue
        if text.startswith("//", i) or text.startswith("/*", i):
            end = text.find("\n", i) if text[i + 1] == "/" else text.find("*/", i + 2) + 1
            i = n if end <= 0 else end + (text[i + 1] == "*")
            newline_since = True
            continue
        if c.isspace():
            newline_since = newline_since or c == "\n"
            out.append(c)
            i += 1
            continue
        if c in "}]" and last_sig == ",":
            del out[len(out) - 1 - out[::-1].index(",")]
            repairs += 1
        elif c == '"' and newline_since and last_sig in _VALUE_END:
            out.append(",")
            repairs += 1
        in_str = c == '"'
        out.append(c)
        last_sig, newline_since = c, False
        i += 1
    return "".join(out), repairs


def load_json(path: str | Path) -> Any:
    """Parse a config file; errors name the file and the position."""
    if "\0" in str(path):
        raise ConfigError(repr(str(path)), None, "a path cannot contain a NUL byte")
    path = Path(path)
    if not _is_file(path):
        raise ConfigError(path, None, "file not found (expected a JSON file)")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, None, f"cannot be read as UTF-8 text: {exc}") from exc
    try:
        return loads(raw, path)
    except ConfigError:
        pass
    text, repairs = _normalise(raw)
    value = loads(text, path)
    log.debug("%s: read with comments or %d comma repairs", path, repairs)
    return value


def _is_file(path: Path) -> bool:
    """`path.is_file()`, False also where the name is too long for the file system."""
    try:
        return path.is_file()
    except OSError:
        return False


def loads(text: str | bytes, source: str | Path | None) -> Any:
    """`json.loads`, with every failure a ConfigError naming `source`: bad syntax (line and
    column), integers too long to convert, nesting too deep."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            source, None, f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(source, None, f"cannot be read as UTF-8 text: {exc}") from exc
    except ValueError as exc:  # an integer longer than Python converts (sys.int_info)
        raise ConfigError(source, None, f"not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(source, None, "not valid JSON: nested too deeply") from exc
