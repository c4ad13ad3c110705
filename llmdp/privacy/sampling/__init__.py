"""llmdp.privacy.sampling (see llmdp/privacy/__init__.py)."""
