"""API keys on requests: a bearer token (`vramcast keys create`) with the scope a route needs."""

from __future__ import annotations

from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.api import problems
from service.api.problems import ProblemError
from service.store.keys import KeyScope, allows, authenticate
from service.store.models import ApiKey

api_key = HTTPBearer(
    scheme_name="ApiKey",
    description="An API key from `vramcast keys create`, sent as `Authorization: Bearer vck_...`.",
    auto_error=False,
)


def require_key(
    session: Session, credentials: HTTPAuthorizationCredentials | None, scope: KeyScope
) -> ApiKey:
    """The live key the request carries, with `scope`; a 401 or 403 problem otherwise."""
    if credentials is None:
        raise ProblemError(problems.unauthorized("this request needs an API key (Bearer)"))
    key = authenticate(session, credentials.credentials)
    if key is None:
        raise ProblemError(problems.unauthorized("the API key is unknown or revoked"))
    if not allows(key, scope):
        raise ProblemError(problems.forbidden(scope.value))
    return key
