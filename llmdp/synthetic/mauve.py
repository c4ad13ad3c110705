"""A MAUVE-style distribution similarity between two sets of embeddings (Pillutla et al.,
NeurIPS 2021), in numpy: what `llmdp synthetic quality` reports between a synthetic corpus
and the held-out split.

1. both sets, stacked in a canonical row order (so that the result does not depend on which
   set is given first), are L2-normalized and projected on the principal components that
   explain ``pca_variance`` of their variance;
2. jointly quantized by k-means (k-means++ seeding from ``seed``, ``n_init`` restarts, the
   lowest inertia kept) into ``num_buckets`` clusters (default: a tenth of the smaller set);
3. P and Q, the two histograms over the clusters, give the divergence frontier
   ``(exp(-s KL(Q || R_λ)), exp(-s KL(P || R_λ)))`` for ``R_λ = λP + (1-λ)Q``, λ on a grid
   in (0, 1), closed by (0, 1) and (1, 0);
4. MAUVE is the area under that frontier: 1 when P = Q, near 0 when they share no cluster
   (≈ 0.004 at the default scale s = 5).

Symmetric: MAUVE(p, q) = MAUVE(q, p) (the frontier is mirrored in the diagonal, its area
unchanged; the clustering sees the same rows). Deterministic for a given ``seed``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mauve", "kmeans", "divergence_frontier", "Quantizer", "fit_quantizer", "frontier_area"]


def _canonical(x: np.ndarray) -> np.ndarray:
    """The rows of ``x`` in lexicographic order (a fixed order whatever order they came in)."""
    return x[np.lexsort(x.T[::-1])] if x.size else x


def _project(x: np.ndarray, pca_variance: float) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norms > 0, norms, 1.0)
    x = x - x.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    var = s ** 2
    if var.sum() <= 0:
        return x[:, :1] * 0.0
    keep = int(np.searchsorted(np.cumsum(var) / var.sum(), pca_variance - 1e-12) + 1)
    return x @ vt[:keep].T


def kmeans(x: np.ndarray, k: int, *, seed: int = 0, n_init: int = 5, max_iter: int = 300,
           tol: float = 1e-8) -> np.ndarray:
    """Cluster labels of the rows of ``x`` (Lloyd's algorithm, k-means++ seeding; the run of
    lowest inertia among ``n_init``)."""
    n = x.shape[0]
    k = max(1, min(int(k), n))
    rng = np.random.default_rng(seed)
    sq = (x * x).sum(axis=1)
    best, best_inertia = None, np.inf
    for _ in range(max(1, n_init)):
        centers = np.empty((k, x.shape[1]), dtype=np.float64)
        centers[0] = x[rng.integers(n)]
        d2 = ((x - centers[0]) ** 2).sum(axis=1)
        for c in range(1, k):
            total = d2.sum()
            i = rng.choice(n, p=d2 / total) if total > 0 else rng.integers(n)
            centers[c] = x[i]
            d2 = np.minimum(d2, ((x - centers[c]) ** 2).sum(axis=1))
        prev = np.inf
        for _ in range(max_iter):
            dist = sq[:, None] - 2.0 * x @ centers.T + (centers * centers).sum(axis=1)[None, :]
            labels = dist.argmin(axis=1)
            inertia = float(np.maximum(dist[np.arange(n), labels], 0).sum())
            for c in range(k):
                members = labels == c
                if members.any():
                    centers[c] = x[members].mean(axis=0)
            if prev - inertia <= tol * max(prev, 1e-30):
                break
            prev = inertia
        if inertia < best_inertia:
            best, best_inertia = labels, inertia
    return best


def _kl(a: np.ndarray, b: np.ndarray) -> float:
    m = a > 0
    return float((a[m] * np.log(a[m] / b[m])).sum())


def divergence_frontier(p: np.ndarray, q: np.ndarray, *, scale: float = 5.0,
                        grid: int = 25) -> np.ndarray:
    """The points (x, y) of the frontier of histograms ``p`` and ``q``, x ascending."""
    lams = np.linspace(1e-6, 1 - 1e-6, grid)
    pts = [(0.0, 1.0), (1.0, 0.0)]
    for lam in lams:
        r = lam * p + (1 - lam) * q
        pts.append((np.exp(-scale * _kl(q, r)), np.exp(-scale * _kl(p, r))))
    pts = np.asarray(pts, dtype=np.float64)
    return pts[np.lexsort((-pts[:, 1], pts[:, 0]))]


def frontier_area(hp: np.ndarray, hq: np.ndarray, *, scale: float = 5.0) -> float:
    """MAUVE of two histograms over the same buckets (each summing to 1): the area under
    their divergence frontier."""
    frontier = divergence_frontier(hp, hq, scale=scale)
    return float(np.sum(np.diff(frontier[:, 0]) * (frontier[1:, 1] + frontier[:-1, 1]) / 2))


class Quantizer:
    """Buckets fitted on one set of embeddings (``fit_quantizer``): the normalization, the
    centering and the principal components of that set, and its k-means centers; ``assign``
    puts any other embeddings in the nearest bucket by the same steps. What it holds is a
    function of the fitting set alone."""

    def __init__(self, mean: np.ndarray, components: np.ndarray, centers: np.ndarray):
        self.mean, self.components, self.centers = mean, components, centers

    @property
    def num_buckets(self) -> int:
        return int(self.centers.shape[0])

    def project(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        return (x / np.where(norms > 0, norms, 1.0) - self.mean) @ self.components.T

    def assign(self, x) -> np.ndarray:
        y = self.project(x)
        d = (y * y).sum(axis=1)[:, None] - 2.0 * y @ self.centers.T + (self.centers ** 2).sum(axis=1)[None, :]
        return d.argmin(axis=1)


def fit_quantizer(features, *, num_buckets: int | str = "auto", seed: int = 0,
                  pca_variance: float = 0.9, n_init: int = 5, max_iter: int = 300) -> Quantizer:
    """A `Quantizer` fitted on ``features`` alone (canonical row order, normalization, PCA
    keeping ``pca_variance``, k-means; ``num_buckets`` "auto": a tenth of the rows)."""
    x = _canonical(np.asarray(features, dtype=np.float64))
    if x.ndim != 2 or not len(x):
        raise ValueError(f"fit_quantizer: a non-empty [n, d] set, got {x.shape}")
    if num_buckets == "auto":
        num_buckets = max(2, int(round(len(x) / 10)))
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    xn = x / np.where(norms > 0, norms, 1.0)
    mean = xn.mean(axis=0, keepdims=True)
    xc = xn - mean
    _, sv, vt = np.linalg.svd(xc, full_matrices=False)
    var = sv ** 2
    keep = 1 if var.sum() <= 0 else int(np.searchsorted(np.cumsum(var) / var.sum(), pca_variance - 1e-12) + 1)
    comps = vt[:keep]
    y = xc @ comps.T
    labels = kmeans(y, int(num_buckets), seed=seed, n_init=n_init, max_iter=max_iter)
    centers = np.stack([y[labels == c].mean(axis=0) for c in np.unique(labels)])
    return Quantizer(mean, comps, centers)


def mauve(p_features, q_features, *, num_buckets: int | str = "auto", seed: int = 0,
          pca_variance: float = 0.9, scale: float = 5.0, n_init: int = 5,
          max_iter: int = 300) -> dict:
    """MAUVE of two embedding sets (rows), with what it was computed from."""
    p = np.asarray(p_features, dtype=np.float64)
    q = np.asarray(q_features, dtype=np.float64)
    if p.ndim != 2 or q.ndim != 2 or p.shape[1] != q.shape[1] or not len(p) or not len(q):
        raise ValueError(f"mauve: two non-empty [n, d] sets of the same d, got {p.shape} and {q.shape}")
    if num_buckets == "auto":
        num_buckets = max(2, int(round(min(len(p), len(q)) / 10)))
    # one canonical order of the union, each row tagged with its set
    both = np.concatenate([np.concatenate([p, np.zeros((len(p), 1))], axis=1),
                           np.concatenate([q, np.ones((len(q), 1))], axis=1)])
    both = _canonical(both)
    side = both[:, -1]
    x = _project(both[:, :-1], pca_variance)
    labels = kmeans(x, int(num_buckets), seed=seed, n_init=n_init, max_iter=max_iter)
    k = int(labels.max()) + 1
    hp = np.bincount(labels[side == 0], minlength=k).astype(np.float64)
    hq = np.bincount(labels[side == 1], minlength=k).astype(np.float64)
    hp, hq = hp / hp.sum(), hq / hq.sum()
    frontier = divergence_frontier(hp, hq, scale=scale)
    area = float(np.sum(np.diff(frontier[:, 0]) * (frontier[1:, 1] + frontier[:-1, 1]) / 2))
    return {"mauve": area, "num_buckets": k, "p_size": len(p), "q_size": len(q),
            "pca_dims": int(x.shape[1]), "scale": scale, "seed": seed}
