"""Per-unit gradient clipping (DESIGN, invariant `one-sensitivity-boundary`, §4)."""

from llmdp.clipping.audit import UnsupportedModuleError, check_model
from llmdp.clipping.engine import ENGINES, GhostClipper
from llmdp.clipping.norms import LayerRule, find_rule, register_rule

__all__ = ["ENGINES", "GhostClipper", "LayerRule", "UnsupportedModuleError", "check_model",
           "find_rule", "register_rule"]
