"""Tuning on private data, with its privacy cost: `sweep` (trials, selection, resume),
`grid` (the grid and random points) and `cost` (the sweep's ε). Runs side by side
(``llmdp compare``) are `llmdp.report.compare`."""
