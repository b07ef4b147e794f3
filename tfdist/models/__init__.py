"""Example models."""

from tfdist.models.cnn import cnn

__all__ = ["cnn"]
