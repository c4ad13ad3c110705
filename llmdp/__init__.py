"""llmdp: differentially private fine-tuning of Hugging Face causal LMs on Ray Train.

The public API, looked up on first use (``import llmdp`` stays light for the CLI):

- ``llmdp.load_recipe(path, overrides)`` -> ``RecipeConfig`` (`llmdp.config.schema`);
- ``llmdp.train_recipe(cfg)``: the whole run, as ``llmdp train`` (`llmdp.run.launch.run`);
- ``llmdp.write_report(run_dir)``: the privacy report of a run directory (`llmdp.report.build`);
- ``llmdp.export_run(run_dir, out)``: the export folder, as ``llmdp export`` (`llmdp.hub.export`);
- ``llmdp.GhostClipper``: the per-unit clipping engine (`llmdp.clipping`).
"""

from __future__ import annotations

__version__ = "0.1.0"

_API = {
    "load_recipe": ("llmdp.config.schema", "load_recipe"),
    "RecipeConfig": ("llmdp.config.schema", "RecipeConfig"),
    "train_recipe": ("llmdp.run.launch", "run"),
    "write_report": ("llmdp.report.build", "write_report"),
    "export_run": ("llmdp.hub.export", "export_run"),
    "GhostClipper": ("llmdp.clipping", "GhostClipper"),
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'llmdp' has no attribute {name!r}")
