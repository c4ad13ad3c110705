"""The run's record: what a run is and what it leaves behind, read and written by every stage
above it and by the driver. `spec`: the frozen RunSpec the driver hands the workers;
`rundir`: the run directory (plan.json, metrics, ledger, checkpoints) and its state;
`checkpoints`: the checkpoint files' format; `provenance`: the starting model's lineage;
`baseline`: the NON-PRIVATE run's labels and report; `publish`: what of a run may be
published. No driver here (`llmdp.run`), and no training (`llmdp.train`)."""
