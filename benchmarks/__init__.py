"""The benchmarks (run as scripts: ``python benchmarks/NAME.py``). A regular package: as a
namespace package it would lose to any regular top-level ``benchmarks`` package installed
beside it (Opacus 1.6 installs one), and the tests' ``benchmarks.*`` imports would find that."""
