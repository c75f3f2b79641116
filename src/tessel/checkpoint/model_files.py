"""The model's own files beside a tessel training checkpoint.

`Session.save_checkpoint` writes, beside `strategy.json` and the rank files:

* `model_state_dict.json`: which checkpoint tensors are the model's `state_dict()`, under which
  keys (the optimizer's states, the program's constants and non-persistent buffers are not);
* `config.json` and `generation_config.json` of a `transformers` model, as `save_pretrained`
  writes them.

`tessel ckpt unify` (and `unified_safetensors`) read them to write a directory that
`from_pretrained` loads: the recorded keys only, and the config files copied. Everything read
here is checked and refused with the file and the key named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path

from tessel.checkpoint.errors import CheckpointError
from tessel.config.fields import Fields, describe

STATE_DICT_FILE = "model_state_dict.json"
STATE_DICT_FORMAT = "tessel.model_state_dict"
CONFIG_FILES = ("config.json", "generation_config.json")
_MAX_JSON = 64 << 20  # a config or key list is KiB to a few MiB


def state_dict_file(state_dict: Mapping[str, str]) -> bytes:
    """The contents of `model_state_dict.json` for `{state_dict key: checkpoint name}`."""
    record = {"format": STATE_DICT_FORMAT, "version": 1, "state_dict": dict(state_dict)}
    return json.dumps(record, indent=1).encode()


def _read_json(path: Path) -> tuple[object, bytes]:
    """A small JSON file's value and bytes, or tessel's error naming it."""
    try:
        size = path.stat().st_size
        if size > _MAX_JSON:
            raise CheckpointError(str(path), None, f"is {size} bytes; at most {_MAX_JSON} expected")
        raw = path.read_bytes()
        return json.loads(raw), raw
    except OSError as e:
        raise CheckpointError(str(path), None, f"cannot be read: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # also bad UTF-8, too-deep nesting
        raise CheckpointError(
            str(path), None, f"is not valid JSON: {e or 'nested too deeply'}"
        ) from None


def read_state_dict(src_dir: str | os.PathLike, names: Collection[str]) -> dict[str, str] | None:
    """`{state_dict key: checkpoint name}` from `src_dir/model_state_dict.json`, every name one
    of `names` (the checkpoint's tensors); None where the directory has no such file."""
    path = Path(src_dir) / STATE_DICT_FILE
    if not path.is_file():
        return None
    top = Fields(_read_json(path)[0], path, error=CheckpointError)
    top.check_keys(("format", "version", "state_dict"))
    top.string("format", choices=(STATE_DICT_FORMAT,))
    top.integer("version", 1, 1)
    group = top.child("state_dict")
    assert group is not None
    known = set(names)
    out: dict[str, str] = {}
    for key, name in group.obj.items():
        fail = group.error_at(group.path(key))
        if not key:
            raise group.error("a state_dict key is empty")
        if not isinstance(name, str) or not name:
            raise fail(f"expected a checkpoint tensor's name, found {describe(name)}")
        if name not in known:
            raise fail(f"names {name!r}, which the checkpoint does not hold")
        out[key] = name
    if not out:
        raise group.error("names no tensor")
    return out


def config_files(src_dir: str | os.PathLike) -> dict[str, bytes]:
    """The config files `src_dir` holds (`config.json`, `generation_config.json`), each checked
    to be a JSON object, as `{file name: bytes}` to copy."""
    out = {}
    for name in CONFIG_FILES:
        path = Path(src_dir) / name
        if not path.is_file():
            continue
        value, raw = _read_json(path)
        if not isinstance(value, dict):
            raise CheckpointError(
                str(path), None, f"expected a JSON object, found {describe(value)}"
            )
        out[name] = raw
    return out
