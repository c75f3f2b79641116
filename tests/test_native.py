"""The workers' native libraries: without a compiler, each is skipped with a warning that says
what runs instead, and nothing half-built is left in the cache."""

import logging

import pytest

from tessel.runtime import cpu_cache, shared_memory


@pytest.mark.parametrize(
    ("module", "instead"),
    [
        (cpu_cache, "run without their block cache"),
        (shared_memory, "meet through gloo's sockets only"),
    ],
    ids=["cpu_cache", "shared_memory"],
)
def test_without_a_compiler_workers_go_on_without_the_library_and_say_so(
    module, instead, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    module.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=module.__name__):
            assert module.library() is None
    finally:
        module.library.cache_clear()
    assert instead in caplog.text
    assert "no-such-compiler" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is published
