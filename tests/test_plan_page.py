"""`tessel inspect --html`: one self-contained page holding the figures of `inspect --json`."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch
from tests.conftest import small_llama, token_ids
from tests.test_stages import cluster, policy

import tessel
from tessel.cli import main
from tessel.package import Package
from tessel.report import inspect_json


class _Page(HTMLParser):
    """The parts of the page a test reads: the embedded figures, every tag's attributes and
    every resource it would fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.fetches: list[str] = []
        self.data_json = ""
        self._in_data = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        for key in ("src", "href"):
            if attrs.get(key):
                self.fetches.append(attrs[key])
        self._in_data = tag == "script" and attrs.get("id") == "plan-data"

    def handle_endtag(self, tag):
        self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data_json += data


@pytest.fixture(scope="module")
def pipeline_package(tmp_path_factory):
    torch.manual_seed(0)
    built = tessel.build(
        small_llama(layers=4), (token_ids(batch=4),), cluster=cluster(4), policy=policy(2, 2)
    )
    return tessel.save(built, tmp_path_factory.mktemp("page") / "pp2tp2")


def test_the_page_holds_the_figures_of_inspect_json(pipeline_package, tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert main(["inspect", str(pipeline_package), "--html", str(page)]) == 0
    assert str(page) in capsys.readouterr().out
    parsed = _Page()
    parsed.feed(page.read_text(encoding="utf-8"))
    data = inspect_json(Package.open(pipeline_package).manifest)
    assert json.loads(parsed.data_json) == json.loads(json.dumps(data))
    assert parsed.fetches == []  # self-contained: nothing to fetch
    world = data["world_size"]
    devices = [a for t, a in parsed.tags if t == "div" and a.get("class") == "device"]
    assert sorted(int(a["data-rank"]) for a in devices) == list(range(world))
    rows = {int(a["data-rank"]): int(a["data-peak"]) for t, a in parsed.tags if "data-peak" in a}
    assert rows == {r["rank"]: r["peak_bytes"] for r in data["ranks"]}
    cells = [int(a["data-bytes"]) for t, a in parsed.tags if t == "td" and "data-bytes" in a]
    assert len(cells) == world * world
    for r in data["ranks"]:  # a rank's row holds what its collectives move, split over peers
        row = cells[r["rank"] * world : (r["rank"] + 1) * world]
        moved = sum(c["bytes"] for c in r["collectives"] if len(c["group"]) > 1)
        assert moved - len(r["collectives"]) * world <= sum(row) <= moved
        assert row[r["rank"]] == 0
    assert any(t == "table" and a.get("id") == "stages" for t, a in parsed.tags)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no headless chromium here")
def test_the_page_renders_in_a_headless_browser(pipeline_package, tmp_path):
    page = tmp_path / "plan.html"
    main(["inspect", str(pipeline_package), "--html", str(page)])
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dom.returncode == 0, dom.stderr
    assert "rank 3" in dom.stdout and 'id="traffic"' in dom.stdout
