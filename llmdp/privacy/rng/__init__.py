"""llmdp.privacy.rng (see llmdp/privacy/__init__.py)."""
