"""The driver: a recipe becomes a planned run (`planning`, `spec`), a run directory
(`rundir`), a launch on Ray Train (`launch`: prepare, the budget hold, the TorchTrainer, the
report at the end) with its progress bar (`progress`), its Ctrl-C (`interrupt`) and the
local Ray's watchdog (`localray`); `submit` sends a recipe to a cluster; `baseline` is the
NON-PRIVATE run's labels and report."""
