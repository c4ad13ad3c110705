"""Empirical privacy auditing (issue 19): canaries in one run, their scores, the one-run
lower bound on ε (Steinke, Nasr and Jagielski 2023), and ``llmdp audit``.

This package's ``__init__`` imports nothing: ``plant`` is imported by the engine and the
reduction (the test-only planted bugs), the rest only by ``llmdp audit``.
"""
