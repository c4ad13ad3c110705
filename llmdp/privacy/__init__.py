"""Privacy core, cut by concept into sub-packages; `plan` composes them.

- `rng`: the ChaCha20 keystream and the keys it is read under;
- `noise`: Gaussian noise drawn from it, and the δ its truncated tails add;
- `sampling`: Poisson, truncated-Poisson and cyclic samplers of privacy units;
- `accounting`: DpEvents, ε / δ over dp-accounting, the σ search, prior releases;
- `mf`: correlated noise by matrix factorization (banded MF, BLT);
- `ledger`: the dataset ledgers (records, database, service, budget);
- `plan`: the frozen `DPPlan` (`make_plan`).

Importable without Ray. Each sub-package's ``__init__.py`` is its entry point (``from
llmdp.privacy.ledger import Ledger``) and looks its names up on first use, so that a process
that needs only the ledger or the accountant (the ledger service's actor, ``llmdp privacy``)
does not load torch, which the keystream behind sampling and noise is computed with. This
package imports nothing; it holds the entry points' one mechanism (`entry_point`).
"""

from __future__ import annotations


def entry_point(package: str, names: dict[str, tuple[str, ...]]):
    """``(__all__, __getattr__, __dir__, name -> module)`` of the sub-package ``package``
    whose ``__init__`` re-exports ``names`` (module -> the names code outside it uses). A
    name is looked up in its defining module at every access, never cached in the package:
    a test that patches the module's attribute is seen by every caller that reaches it
    through the package, and importing the package loads none of its modules."""
    homes = {name: module for module, ns in names.items() for name in ns}

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(f"{package}.{home}"), name)

    def __dir__():
        import sys

        return sorted(set(vars(sys.modules[package])) | set(homes))

    return sorted(n for n in homes if not n.startswith("_")), __getattr__, __dir__, homes
