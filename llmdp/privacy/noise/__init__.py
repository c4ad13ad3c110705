"""llmdp.privacy.noise (see llmdp/privacy/__init__.py)."""
