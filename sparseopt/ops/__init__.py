"""Ops for layers that own sparse tables."""

from sparseopt.ops.lookup import SparseLookup

__all__ = ["SparseLookup"]
