"""The built-in per-unit gradient rules; importing this package registers them
(``norms.register_rule``)."""

from llmdp.clipping.norms import register_rule
from llmdp.clipping.rules.embedding import EmbeddingRule
from llmdp.clipping.rules.experts import ExpertsRule
from llmdp.clipping.rules.functional import SubtreeRule, is_param_wrapper
from llmdp.clipping.rules.linear import LinearRule
from llmdp.clipping.rules.rowwise import RowwiseRule

register_rule(match=is_param_wrapper)(SubtreeRule())

__all__ = ["SubtreeRule", "EmbeddingRule", "ExpertsRule", "LinearRule", "RowwiseRule"]
