"""Pictures of a training run: curves, predicted digits, confusion matrix (matplotlib, no display needed)."""

from __future__ import annotations

import numpy as np

from tfdist.errors import import_extra

__all__ = ["confusion_matrix", "plot_confusion", "plot_curves", "plot_predictions", "pyplot"]


def pyplot():
    """matplotlib.pyplot, on the Agg backend outside notebooks (scripts and CI have no display)."""
    matplotlib = import_extra("matplotlib", "examples", "drawing pictures (tfdist.plots)")
    if not _in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False


def plot_curves(history: dict[str, list[float]], path: str | None = None, title: str = "Training"):
    """Plots loss and accuracy per epoch (train and, if present, validation); saves to `path` if given."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        for key, style in ((metric, "-o"), (f"val_{metric}", "--s")):
            if key in history:
                epochs = range(1, len(history[key]) + 1)
                ax.plot(epochs, history[key], style, label="test" if key.startswith("val_") else "train")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def plot_predictions(images: np.ndarray, labels: np.ndarray, predicted: np.ndarray, cols: int = 8, path: str | None = None):
    """A grid of images titled 'predicted (true)'; wrong predictions in red."""
    plt = pyplot()
    rows = int(np.ceil(len(images) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.3, rows * 1.5))
    for ax, img, true, pred in zip(np.ravel(axes), images, labels, predicted):
        ax.imshow(img.squeeze(), cmap="gray_r")
        ax.set_title(f"{pred} ({true})", color="black" if pred == true else "red", fontsize=9)
    for ax in np.ravel(axes):
        ax.axis("off")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[i, j] = number of class-i images predicted as j."""
    counts = np.zeros((num_classes, num_classes), dtype=int)
    np.add.at(counts, (labels, predicted), 1)
    return counts


def plot_confusion(labels: np.ndarray, predicted: np.ndarray, num_classes: int, path: str | None = None):
    """A confusion-matrix heat map with counts written in each cell."""
    plt = pyplot()
    counts = confusion_matrix(labels, predicted, num_classes)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(counts, cmap="Blues")
    for (i, j), n in np.ndenumerate(counts):
        if n:
            ax.text(j, i, n, ha="center", va="center", fontsize=8, color="white" if n > counts.max() / 2 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_xticks(range(num_classes))
    ax.set_yticks(range(num_classes))
    fig.colorbar(im)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig
