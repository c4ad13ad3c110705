"""llmdp.privacy.ledger (see llmdp/privacy/__init__.py)."""
