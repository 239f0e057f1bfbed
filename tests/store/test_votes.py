"""Votes belong to keys, on SQLite and PostgreSQL: a key uploads only for its nodes, casts one
vote whatever node ids it names, and an operator's purge of its uploads leaves the stored
factors equal to a full refit of what remains."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.calibration.factors import fit_factor_table, load_factor_table, stored_factor_table
from service.calibration.uploads import revoke, submit_upload
from service.core.calibration import EMPTY_TABLE, Level, Scope
from service.store.keys import KeyScope, NodeNotAllowedError, create_key
from service.store.models import ApiKey, CalibrationChange, CalibrationRatio, CalibrationUpload
from tests.store.factories import VERSION, fake_estimate, new_upload, node_key, render

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
MODELS = ("org/alpha-7b", "org/beta-8b", "org/gamma-13b")


def submit(session: Session, key: ApiKey, upload: Any) -> None:
    submit_upload(
        session,
        upload,
        api_key_id=key.id,
        idempotency_key=None,
        estimate=fake_estimate,
        factors=EMPTY_TABLE,
        render=render,
        now=lambda: NOW,
    )


def uploads(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(CalibrationUpload)) or 0


def test_a_key_uploads_only_for_the_nodes_it_was_made_for(session: Session) -> None:
    rack = create_key(
        session, scopes=[KeyScope.UPLOAD], name="rack", now=NOW, nodes=["rack3-*"]
    ).key
    submit(session, rack, new_upload(node_id="rack3-gpu1"))
    with pytest.raises(NodeNotAllowedError) as refused:
        submit(session, rack, new_upload(node_id="rack4-gpu1"))
    assert refused.value.node_id == "rack4-gpu1" and refused.value.prefix == rack.prefix
    assert uploads(session) == 1
    # An admin key uploads for any node id, and votes as itself.
    admin = create_key(session, scopes=[KeyScope.ADMIN], name="admin", now=NOW).key
    submit(session, admin, new_upload(node_id="rack4-gpu1"))
    voters = session.scalars(select(CalibrationRatio.voter).order_by(CalibrationRatio.id)).all()
    assert voters == [rack.prefix, admin.prefix]


def test_one_key_casts_one_vote_whatever_node_ids_it_names(session: Session) -> None:
    impostor = create_key(session, scopes=[KeyScope.UPLOAD], name="i", now=NOW, nodes=["*"]).key
    for model in MODELS:
        for node in ("fake-a", "fake-b", "fake-c"):
            upload = new_upload(
                model=model, estimate_gib=10.0, device_gib=0.012, node_id=node, run_id=node
            )
            submit(session, impostor, upload)
    assert load_factor_table(session, VERSION) == EMPTY_TABLE == fit_factor_table(session, VERSION)
    # The same runs from three keys are three votes.
    for model in MODELS:
        for node in ("real-a", "real-b", "real-c"):
            upload = new_upload(model=model, estimate_gib=10.0, device_gib=12.6, node_id=node)
            submit(session, node_key(session, node), upload)
    table = load_factor_table(session, VERSION)
    assert table == fit_factor_table(session, VERSION)
    found = table.lookup(model=MODELS[0], method="lora", level=Level.DEVICE)
    assert found is not None and found.factor.nodes == 3
    # (The impostor's one vote is rejected: far below the others.)
    assert found.factor.rejected_nodes == (impostor.prefix,)


def test_revoking_with_purge_refits_the_factors_without_the_key_s_uploads(
    session: Session,
) -> None:
    for model in MODELS:
        for node, ratio in (("a", 1.10), ("b", 1.12), ("c", 1.08), ("d", 1.3)):
            upload = new_upload(
                model=model, estimate_gib=10.0, device_gib=12.0 * ratio, node_id=node
            )
            submit(session, node_key(session, node), upload)
    before = load_factor_table(session, VERSION)
    assert {key.scope for key in before.factors} == {Scope.MODEL, Scope.GLOBAL}
    d = node_key(session, "d")

    revocation = revoke(session, d.prefix, purge=True, estimator_version=VERSION, now=NOW)
    assert revocation is not None and revocation.purge is not None
    assert (revocation.purge.uploads, revocation.purge.ratios) == (3, 3)
    assert revocation.purge.refitted == 1  # (lora, device)
    assert session.scalar(select(func.count()).select_from(CalibrationChange)) == 0
    after = stored_factor_table(session, VERSION)
    assert after == fit_factor_table(session, VERSION) != before
    assert all(factor.nodes == 3 for factor in after.factors.values())
    assert uploads(session) == 9
    assert d.revoked_at == NOW
    # The last voters' uploads gone, no factor is left standing on them.
    for node in ("a", "b"):
        key = node_key(session, node)
        revoke(session, key.prefix, purge=True, estimator_version=VERSION, now=NOW)
    assert (
        stored_factor_table(session, VERSION) == EMPTY_TABLE == fit_factor_table(session, VERSION)
    )


def test_revoking_without_purge_keeps_the_uploads(session: Session) -> None:
    key = node_key(session, "a")
    submit(session, key, new_upload(node_id="a"))
    revocation = revoke(session, key.prefix, purge=False, estimator_version=VERSION, now=NOW)
    assert revocation is not None and revocation.purge is None and revocation.revoked_at == NOW
    assert key.revoked_at == NOW and uploads(session) == 1
    assert revoke(session, "00000000", purge=True, estimator_version=VERSION, now=NOW) is None
