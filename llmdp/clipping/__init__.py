"""Per-unit gradient clipping (DESIGN §3.1, §4)."""

from llmdp.clipping.engine import ENGINES, GhostClipper, UnsupportedModuleError, check_model

__all__ = ["ENGINES", "GhostClipper", "UnsupportedModuleError", "check_model"]
