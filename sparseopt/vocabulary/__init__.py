"""Open vocabularies: tables keyed by raw ids, with admission and eviction.

`sparseopt.layers.DynamicEmbedding` is the layer; `OpenVocabulary` its map's
settings and state; `keys.split_int64` makes the `(high, low)` int32 halves
that carry 64-bit ids on JAX. See docs/open_vocabularies.md.
"""

from sparseopt.vocabulary.keys import join_int64, split_int64
from sparseopt.vocabulary.export import Delta
from sparseopt.vocabulary.open_vocabulary import (COUNTS, EVICTIONS, OpenVocabulary,
                                                   Proposals)

__all__ = ["COUNTS", "EVICTIONS", "Delta", "OpenVocabulary", "Proposals", "join_int64",
           "split_int64"]
