"""llmdp.privacy.mf (see llmdp/privacy/__init__.py)."""
