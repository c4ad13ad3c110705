"""Privacy core, cut by concept into sub-packages; `plan` composes them.

- `rng`: the ChaCha20 keystream and the keys it is read under;
- `noise`: Gaussian noise drawn from it, and the δ its truncated tails add;
- `sampling`: Poisson, truncated-Poisson and cyclic samplers of privacy units;
- `accounting`: DpEvents, ε / δ over dp-accounting, the σ search, prior releases;
- `mf`: correlated noise by matrix factorization (banded MF, BLT);
- `ledger`: the dataset ledgers (records, database, service, budget, CLI);
- `plan`: the frozen `DPPlan` (`make_plan`).

Importable without Ray. Each sub-package's ``__init__.py`` is its entry point (``from
llmdp.privacy.ledger import Ledger``) and looks its names up on first use, so that a process
that needs only the ledger or the accountant (the ledger service's actor, ``llmdp privacy``)
does not load torch, which the keystream behind sampling and noise is computed with. This
package imports nothing.
"""
