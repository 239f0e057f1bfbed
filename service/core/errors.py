"""Errors raised by the estimator core; they know nothing about HTTP.

EstimatorError
├── InvalidSpecError(ValueError)        a spec field, or a combination of fields, is invalid
├── InvalidConfigError(ValueError)      a model config.json cannot describe a model we know
├── UnknownModelError(LookupError)      a model id is in no catalog (carries close matches)
└── ImplausibleMeasurementError(ValueError)
                                        a measured peak that cannot be true; defined beside
                                        the factor math in service.core.calibration
"""

from __future__ import annotations


class EstimatorError(Exception):
    """Base of every error the core raises."""


class InvalidSpecError(ValueError, EstimatorError):
    """A training spec is invalid; `field` names the offending input (dotted path)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class InvalidConfigError(ValueError, EstimatorError):
    """A model config cannot be turned into an architecture."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"config.{field}: {reason}")
        self.field = field
        self.reason = reason


class UnknownModelError(LookupError, EstimatorError):
    """A model id matches nothing in the catalog; `suggestions` are the closest ids."""

    def __init__(self, model_id: str, suggestions: tuple[str, ...] = ()) -> None:
        hint = f"; closest: {', '.join(suggestions)}" if suggestions else ""
        super().__init__(f"unknown model {model_id!r}{hint}")
        self.model_id = model_id
        self.suggestions = suggestions
