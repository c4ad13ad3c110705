"""The built-in per-unit gradient rules; importing this package registers them
(``norms.register_rule``)."""

from llmdp.clipping.rules.embedding import EmbeddingRule
from llmdp.clipping.rules.experts import ExpertsRule
from llmdp.clipping.rules.linear import LinearRule
from llmdp.clipping.rules.rowwise import RowwiseRule

__all__ = ["EmbeddingRule", "ExpertsRule", "LinearRule", "RowwiseRule"]
