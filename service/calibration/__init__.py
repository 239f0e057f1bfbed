"""Calibration: measured peaks stored, turned into factors, and applied to estimates.

`uploads` stores uploads and derives their ratios, `factors` fits and caches the factors,
`provider` applies them to estimates, `service` is what the API's routes use. The
maths is the core's (`service.core.calibration`); this package adds the store and catalogs.
"""

from service.calibration.uploads import EstimateFn, rederive_ratios

__all__ = ["EstimateFn", "rederive_ratios"]
