"""Builds the API reference (HTML, with pdoc) from the docstrings of tfdist's public modules, and checks it:
every link inside it leads to a page and an anchor that exist.

    python docs/build_api.py out/api        # `make api`; open out/api/index.html

The modules are those a user calls (docs/README.md): the top level (strategies, DeviceMesh, LayoutMap), the
collectives, the data helpers, callbacks, devices, the cluster, ZeRO, tensor parallelism, pipelines, the gradient
hooks. Strategy internals and the command line's modules are left out (`tfdist --help` documents the command).
"""

from __future__ import annotations

import html.parser
import os
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

PUBLIC = ["tfdist", "tfdist.errors", "tfdist.data_parallel.comm_hooks", "tfdist.data_parallel.powersgd"]
HIDDEN = ["!tfdist.cli", "!tfdist.cli.*"]


def build(out: Path) -> list[Path]:
    """Writes the reference into `out`; returns its HTML pages."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="google", show_source=False, footer_text="tfdist API reference")
    pdoc.pdoc(*PUBLIC, *HIDDEN, output_directory=out)
    return sorted(out.rglob("*.html"))


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def broken_links(out: Path) -> list[str]:
    """'page: href' for every link to a page or anchor of the reference that does not exist."""
    pages = {}
    for page in out.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        pages[page.resolve()] = parser
    broken = []
    for page, parser in pages.items():
        for href in parser.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("data:"):
                continue  # the web: pdoc's own links, never tfdist's pages
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target not in pages:
                broken.append(f"{page.relative_to(out.resolve())}: {href} (no page)")
            elif parts.fragment and unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{page.relative_to(out.resolve())}: {href} (no anchor)")
    return broken


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "out/api")
    pages = build(out)
    broken = broken_links(out)
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    print(f"{len(pages)} pages in {out}; open {out / 'index.html'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
