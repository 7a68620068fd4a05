"""Layers that own sparse tables."""

from sparseopt.layers.dynamic_embedding import DynamicEmbedding
from sparseopt.layers.sparse_embedding import SparseEmbedding

__all__ = ["DynamicEmbedding", "SparseEmbedding"]
