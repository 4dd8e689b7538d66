"""`OnlineLinear`: y ~ theta . x learned online, the fit behind every speed the cost model
reads (router/routing/speed_learner.py says which).

Recursive least squares with exponential forgetting, residuals clipped once warmed up,
the covariance bounded by the prior's. Updates of the two- and three-coefficient fits (the
only ones the learner keeps) are written out: four of them follow every finished request,
and the general form's comprehensions cost ~2.4x as much (~9 against ~4 us an update); the
general form remains for any other size and is what the written-out ones are tested
against (tests/unit/routing/test_online_fit.py).
"""

from __future__ import annotations

from operator import mul

# Forgetting factor: a sample's weight halves after ~70 newer samples, so the fit follows
# an engine that slows down (a noisy neighbour, a bigger batch) within a minute or two.
FORGET = 0.99
# Residuals are clipped at this many times their running mean size once warmed up.
CLIP_SCALE = 5.0
WARMUP_SAMPLES = 8
# Typical scatter of an observed time to first token around the model (seconds).
NOISE_S = 0.005


class OnlineLinear:
    """y ~ theta . x by recursive least squares with forgetting, started at a prior.

    `prior_sd` is how far each coefficient may plausibly be from its prior. RLS weighs the
    prior against the samples as if each sample's noise were 1, so the prior's covariance
    is (prior_sd / NOISE_S)^2: samples with NOISE_S of scatter outweigh the prior after a
    handful. The covariance never grows past it, so a direction the data stops exciting
    (say, no decoding sequences for a while) does not wind up."""

    __slots__ = ("_p", "_p0", "_resid", "forget", "samples", "theta")

    def __init__(self, prior: tuple[float, ...], prior_sd: tuple[float, ...], forget: float = FORGET):
        n = len(prior)
        self.theta = list(prior)
        self._p0 = [(sd / NOISE_S) ** 2 for sd in prior_sd]
        self._p = [[self._p0[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forget = forget
        self.samples = 0
        self._resid = 0.0  # running mean of |residual|

    def predict(self, x: tuple[float, ...]) -> float:
        return float(sum(map(mul, self.theta, x)))

    def observe(self, x: tuple[float, ...], y: float) -> None:
        n = len(x)
        if n == 2:
            x0, x1 = x
            (p00, p01), (p10, p11) = self._p
            px0, px1 = p00 * x0 + p01 * x1, p10 * x0 + p11 * x1
            denom = self.forget + (x0 * px0 + x1 * px1)
            if denom <= 0.0:
                return
            t0, t1 = self.theta
            r_used = self._residual(y - (t0 * x0 + t1 * x1))
            k0, k1 = px0 / denom, px1 / denom
            self.theta = [t0 + k0 * r_used, t1 + k1 * r_used]
            lam = self.forget
            self._p = [
                [(p00 - k0 * px0) / lam, (p01 - k0 * px1) / lam],
                [(p10 - k1 * px0) / lam, (p11 - k1 * px1) / lam],
            ]
        elif n == 3:
            x0, x1, x2 = x
            (p00, p01, p02), (p10, p11, p12), (p20, p21, p22) = self._p
            px0 = p00 * x0 + p01 * x1 + p02 * x2
            px1 = p10 * x0 + p11 * x1 + p12 * x2
            px2 = p20 * x0 + p21 * x1 + p22 * x2
            denom = self.forget + (x0 * px0 + x1 * px1 + x2 * px2)
            if denom <= 0.0:
                return
            t0, t1, t2 = self.theta
            r_used = self._residual(y - (t0 * x0 + t1 * x1 + t2 * x2))
            k0, k1, k2 = px0 / denom, px1 / denom, px2 / denom
            self.theta = [t0 + k0 * r_used, t1 + k1 * r_used, t2 + k2 * r_used]
            lam = self.forget
            self._p = [
                [(p00 - k0 * px0) / lam, (p01 - k0 * px1) / lam, (p02 - k0 * px2) / lam],
                [(p10 - k1 * px0) / lam, (p11 - k1 * px1) / lam, (p12 - k1 * px2) / lam],
                [(p20 - k2 * px0) / lam, (p21 - k2 * px1) / lam, (p22 - k2 * px2) / lam],
            ]
        elif not self._observe_any(x, y):
            return
        self._bound_and_count()

    def _bound_and_count(self) -> None:
        """After an update: no wind-up past the prior's uncertainty; one sample more."""
        p = self._p
        for i, p0 in enumerate(self._p0):
            if p[i][i] > p0:
                s = (p0 / p[i][i]) ** 0.5
                for row in p:
                    row[i] *= s
                p[i] = [v * s for v in p[i]]
        self.samples += 1

    def _observe_any(self, x: tuple[float, ...], y: float) -> bool:
        """The update of any size, before `_bound_and_count` (the written-out ones above
        compute the same, in the same order); False: a degenerate sample, nothing changed."""
        p = self._p
        px = [sum(map(mul, row, x)) for row in p]
        denom = self.forget + sum(map(mul, x, px))
        if denom <= 0.0:
            return False
        r_used = self._residual(y - self.predict(x))
        k = [v / denom for v in px]
        self.theta = [t + ki * r_used for t, ki in zip(self.theta, k, strict=True)]
        lam = self.forget
        self._p = [
            [(pij - ki * pxj) / lam for pij, pxj in zip(row, px, strict=False)] for row, ki in zip(p, k, strict=False)
        ]
        return True

    def _residual(self, r: float) -> float:
        """The residual the update uses (clipped once warmed up), its running size updated."""
        if self.samples >= WARMUP_SAMPLES and self._resid > 0.0:
            bound = CLIP_SCALE * self._resid
            r_used = min(max(r, -bound), bound)
        else:
            r_used = r
        # Grows by at most 1.4x a sample on clipped outliers: a real change of speed is
        # followed within a dozen samples, a lone outlier barely moves it.
        self._resid = abs(r) if self.samples == 0 else 0.9 * self._resid + 0.1 * abs(r_used)
        return r_used
