"""Tuning on private data, with its privacy cost: `sweep` (trials, selection, resume),
`grid` (the grid and random points), `cost` (the sweep's ε) and `compare` (runs side by
side)."""
