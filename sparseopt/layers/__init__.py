"""Layers that own sparse tables."""

from sparseopt.layers.sparse_embedding import SparseEmbedding

__all__ = ["SparseEmbedding"]
