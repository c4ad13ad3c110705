"""The PLD grids llmdp accounts on: plain numbers, so that what reads them (the σ search's
constants, a training worker loading the plan) needs no dp-accounting to import them."""

# dp-accounting's default. Measured on 2 CPU cores for q=0.01, T=2000, sigma~1: ~0.5-1.2 s
# per epsilon (1e-3 would be ~10x faster but over-reports epsilon by ~0.1%-0.3%).
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4

# A coarser PLD grid: ~10x faster, pessimistic like the default (it rounds privacy losses
# up), and a little looser (~0.1-0.3% larger epsilon). For progress bars, plots and the
# planner's searches only; reported guarantees always use `accountant.epsilon`.
PLD_DISPLAY_DISCRETIZATION_INTERVAL = 1e-3
