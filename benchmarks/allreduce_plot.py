"""The PNG of `tfdist bench allreduce`: bus bandwidth per engine against the tensor size, one panel per link."""

from __future__ import annotations

import os

# TF records: one row per size, an engine per key prefix; Horovod records: engine -> size -> entry.
_TF_ENGINES = {"": "tfdist ring (subdivided)", "pieces_": "tfdist ring in pieces", "stock_": "TF's default ring"}


def png_path(json_path: str) -> str:
    """Where the figure of the record written to `json_path` goes: beside it, as .png."""
    return os.path.splitext(json_path)[0] + ".png"


def _series(link: dict) -> tuple[dict[str, list[tuple[float, float]]], bool]:
    """{engine: [(size MB, value)]} and whether values are a share of the link rate (else GB/s)."""
    on_link = link.get("link_rate", "loopback") not in (None, "loopback")
    results = link.get("results", [])
    series: dict[str, list[tuple[float, float]]] = {}
    if isinstance(results, list):  # TF
        for prefix, name in _TF_ENGINES.items():
            key = f"{prefix}busbw_over_link" if on_link else f"{prefix}busbw_gbps"
            points = [(r["size_mb"], r[key]) for r in results if key in r]
            if points:
                series[name] = points
    else:  # Horovod
        for engine, by_size in results.items():
            key = "busbw_over_link" if on_link else "busbw_gbps"
            points = [(float(size), entry[key]) for size, entry in by_size.items() if key in entry]
            if points:
                series[engine] = sorted(points)
    return series, on_link


def plot(record: dict, path: str) -> None:
    """Writes the figure of an all-reduce record (either backend, with or without emulated links)."""
    from benchmarks.common import save_figure
    from tfdist.plots import pyplot

    plt = pyplot()
    links = record.get("links") or [record]
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        series, on_link = _series(link)
        for name, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        sizes = sorted({p[0] for points in series.values() for p in points})
        if on_link:
            ax.axhline(0.9, color="0.5", lw=0.8, ls="--", label="0.9 x link")
            tcp = (link.get("tcp") or {}).get("goodput_over_link")
            if tcp:
                ax.axhline(tcp, color="k", lw=0.8, label=f"raw TCP both ways ({tcp:.2f})")
            low = min([p[1] for points in series.values() for p in points] + [0.9])
            ax.set_ylim(low - 0.05, max(1.0, tcp or 0) + 0.02)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{size:g}" for size in sizes])
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel("bus bandwidth / link rate" if on_link else "bus bandwidth (GB/s)")
        ax.set_title(f"{record.get('backend')} backend, link {link.get('link_rate') or 'loopback'}", fontsize=9)
        ax.legend(fontsize=7)
    meta = {**links[0], **record}  # TF keeps these per link, Horovod per record
    fig.suptitle(f"all-reduce, {meta.get('num_workers') or meta.get('ranks')} processes, "
                 f"median of {meta.get('iters')} x {meta.get('rounds')} interleaved rounds", fontsize=9)
    save_figure(fig, path)
