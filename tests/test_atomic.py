"""Files written under a temporary name and renamed into place: synced before the rename, and
no temporary left behind when writing, syncing or renaming fails (strategy files and
`tessel run --output` among them)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors.torch import load_file

import tessel.atomic as atomic
from tessel.atomic import replace_atomically
from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.strategy import ParamLayout, Strategy, load_strategy, write_strategy
from tessel.config.errors import ConfigError
from tessel.runtime.cli_run import write_outputs


def _listing(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_the_new_file_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with replace_atomically(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing changes until the block ends
    assert target.read_text() == "new"
    assert _listing(tmp_path) == ["out.txt"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc")
def test_the_data_is_synced_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    target = tmp_path / "out.txt"
    with replace_atomically(target) as tmp:
        tmp.write_text("data")
    assert events == [("fsync", str(tmp)), ("replace", str(tmp)), ("fsync", str(tmp_path))]


@pytest.mark.parametrize("where", ["write", "sync", "rename"])
def test_a_failure_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, where):
    target = tmp_path / "out.txt"
    target.write_text("old")
    full = OSError(errno.ENOSPC, "No space left on device")

    def fail(*args):
        raise full

    if where == "sync":
        monkeypatch.setattr(atomic.os, "fsync", fail)
    if where == "rename":
        monkeypatch.setattr(atomic.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        with replace_atomically(target) as tmp:
            tmp.write_text("half")
            if where == "write":
                raise full
    assert target.read_text() == "old"
    assert _listing(tmp_path) == ["out.txt"]


def test_an_interrupted_write_leaves_no_temporary(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with replace_atomically(tmp_path / "out.txt") as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert _listing(tmp_path) == []


def test_a_file_system_that_cannot_sync_still_gets_the_file(tmp_path, monkeypatch):
    def cannot(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(atomic.os, "fsync", cannot)
    with replace_atomically(tmp_path / "out.txt") as tmp:
        tmp.write_text("data")
    assert (tmp_path / "out.txt").read_text() == "data"


def _strategy() -> Strategy:
    layout = ParamLayout(dev_matrix=(2,), tensor_map=((0,), ()), shape=(4, 4), dtype="float32")
    return Strategy({"w": layout})


def test_write_strategy_is_atomic_and_its_failure_is_a_strategy_error(tmp_path, monkeypatch):
    path = tmp_path / "strategy.json"
    write_strategy(_strategy(), path)
    assert load_strategy(path).params == _strategy().params
    before = path.read_bytes()

    def disk_full(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(path), "write_text", disk_full)
    with pytest.raises(StrategyError, match=r"strategy.json: cannot write .*No space left"):
        write_strategy(_strategy(), path)
    assert path.read_bytes() == before
    assert _listing(tmp_path) == ["strategy.json"]


def test_write_outputs_is_atomic_and_its_failure_is_a_config_error(tmp_path, monkeypatch):
    import tessel.runtime.cli_run as cli_run

    path = tmp_path / "sub" / "y.safetensors"
    write_outputs(str(path), [torch.arange(6.0).reshape(2, 3).t()])  # made contiguous
    assert torch.equal(load_file(str(path))["output_0"], torch.arange(6.0).reshape(2, 3).t())
    before = path.read_bytes()

    def disk_full(tensors, filename):
        with open(filename, "wb") as f:
            f.write(b"\0" * 8)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli_run, "save_file", disk_full)
    with pytest.raises(ConfigError, match=r"y.safetensors: cannot write it: No space left"):
        write_outputs(str(path), [torch.zeros(2)])
    assert path.read_bytes() == before
    assert _listing(path.parent) == ["y.safetensors"]


def test_a_published_file_has_an_ordinary_mode_not_the_temporarys(tmp_path):
    from tessel.package.format import write_package
    from tessel.package.manifest import Manifest

    mask = os.umask(0o027)
    try:
        target = tmp_path / "new.txt"
        with replace_atomically(target) as tmp:
            tmp.write_text("x")
        assert target.stat().st_mode & 0o777 == 0o640  # 0666 less the umask
        target.chmod(0o604)
        with replace_atomically(target) as tmp:
            tmp.write_text("y")
        assert target.stat().st_mode & 0o777 == 0o604  # the replaced file's mode is kept
        # packages are published the same way
        import tessel

        built = tessel.build(torch.nn.Linear(2, 2), (torch.ones(1, 2),), cluster=1)
        assert isinstance(built.manifest, Manifest)
        path = write_package(tmp_path / "m", built.manifest, built.members)
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(mask)


def test_missing_parent_directories_are_made(tmp_path):
    target = tmp_path / "a" / "b" / "page.html"
    with replace_atomically(target) as tmp:
        tmp.write_text("x")
    assert target.read_text() == "x"
