"""API keys for operators (the admin scope): each key's uploads, revocation and purge."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from service.api.deps import AdminKeyDep, CalibrationsDep, SessionDep, services_of
from service.api.problems import ProblemError, http_problem, responses
from service.api.responses import json_response
from service.api.schemas.keys import KeyFilterIn, KeyListOut, KeyOut, RevocationOut
from service.store.keys import PREFIX_PATTERN

router = APIRouter(prefix="/v1", tags=["keys"])

Prefix = Annotated[
    str,
    Path(
        pattern=PREFIX_PATTERN.pattern,
        description="The key's prefix, as `GET /v1/keys` and `vramcast keys list` show it.",
    ),
]


@router.get(
    "/keys",
    response_model=KeyListOut,
    summary="List API keys",
    description="Every live key (with `all`, the revoked ones too), oldest first, with the "
    "node ids an upload key may upload for and how many uploads it made; never a secret. "
    "Needs a key with the admin scope.",
    responses=responses(401, 403, 422, 503),
)
def list_keys(
    filters: Annotated[KeyFilterIn, Query()],
    _admin: AdminKeyDep,
    session: SessionDep,
    calibrations: CalibrationsDep,
) -> Response:
    usage = calibrations.keys(session, include_revoked=filters.all)
    return json_response(KeyListOut(keys=[KeyOut.from_core(key) for key in usage]))


@router.delete(
    "/keys/{prefix}",
    response_model=RevocationOut,
    summary="Revoke an API key",
    description="Revoke the key (again: nothing changes); with `purge=true`, also delete every "
    "calibration upload made with it, and refit the factors without them. Needs a key with "
    "the admin scope.",
    responses=responses(401, 403, 404, 422, 503),
)
def revoke_key(
    request: Request,
    prefix: Prefix,
    _admin: AdminKeyDep,
    session: SessionDep,
    calibrations: CalibrationsDep,
    purge: Annotated[
        bool, Query(description="Delete the key's uploads and refit the factors.")
    ] = False,
) -> Response:
    revocation = calibrations.revoke(session, prefix, purge=purge, now=datetime.now(UTC))
    if revocation is None:
        raise ProblemError(http_problem(404, f"no API key has the prefix {prefix!r}"))
    services_of(request).keys.forget_key(revocation.key.id)
    return json_response(RevocationOut.from_core(revocation))
