"""Refuse to start workers from a script's top level, before any worker starts.

A session's workers start as spawned processes do (forked from a fork server that has not run
the script, or spawned): each imports the main script again (as `__mp_main__`) to find what the
parent defined. A script that loads a graph at its top level, outside
`if __name__ == "__main__":`, would have every worker run the script too: build and write the
package again, start a session of its own. This module looks at the running script itself, so
the mistake is named at once instead of after the workers fail.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from types import FrameType


def unguarded_call_site(frame: FrameType | None) -> tuple[str, int] | None:
    """`(file, line)` of the main script's top-level statement running below `frame` where that
    statement is not under an `if __name__ == "__main__":` guard; None where it is, or where the
    main module has no file a spawned worker would run again (an interactive session,
    `python -c`, a notebook) or its source cannot be read."""
    main = sys.modules.get("__main__")
    if main is None or not getattr(main, "__file__", None):
        return None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            break
        frame = frame.f_back
    if frame is None:  # the script's top level has finished (atexit, another thread)
        return None
    file, line = frame.f_code.co_filename, frame.f_lineno
    guards = _guarded_lines(file)
    if guards is None or any(first <= line <= last for first, last in guards):
        return None
    return file, line


@lru_cache(maxsize=8)
def _guarded_lines(file: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of every `if __name__ == "__main__":` body in `file`; None if unreadable."""
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), file)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return tuple(
        (node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_main_test(node.test)
    )


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = (test.left, test.comparators[0])
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )
