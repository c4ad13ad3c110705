"""llmdp.privacy.accounting (see llmdp/privacy/__init__.py)."""
