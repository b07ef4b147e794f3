"""The API reference (docs/build_api.py, `make api`): built from the docstrings, no broken link inside it, every
public name on its page, and one page opened in a real browser (headless Chromium) to see that it renders."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs"))
import build_api  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Chromium as root on a closed network: no sandbox, no GPU, none of its background connections.
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    return out, build_api.build(out)


def test_the_reference_has_every_public_name_and_no_broken_link(reference):
    import tfdist

    out, pages = reference
    assert {p.relative_to(out).as_posix() for p in pages} >= {
        "index.html", "tfdist.html", "tfdist/comm.html", "tfdist/training.html", "tfdist/data.html",
        "tfdist/zero.html", "tfdist/tensor_parallel.html", "tfdist/errors.html"}
    top = (out / "tfdist.html").read_text(encoding="utf-8")
    for name in tfdist.__all__:
        assert f'id="{name}"' in top or f'href="tfdist/{name}.html"' in top, f"tfdist.{name} is not in the reference"
    assert build_api.broken_links(out) == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html#x">b</a><a href="#here">h</a><p id="here"></p>'
                                     '<a href="https://example.org">web</a>')
    (tmp_path / "b.html").write_text('<p id="y"></p>')
    assert build_api.broken_links(tmp_path) == ["a.html: b.html#x (no anchor)"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (make test installs Debian's chromium)")
def test_a_page_renders_in_chromium(reference, tmp_path):
    import matplotlib.image

    out, _ = reference
    page = (out / "tfdist.html").as_uri()
    common = [CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", page], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "MirroredStrategy" in dom and "ModelParallelStrategy" in dom and "Submodules" in dom
    shot = tmp_path / "tfdist.png"
    subprocess.run([*common, "--window-size=1280,1000", f"--screenshot={shot}", page], capture_output=True,
                   timeout=120, check=True)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1000, 1280)
    assert pixels[..., :3].std() > 0.05, "the screenshot is blank"  # text, code and the sidebar, not one colour
