"""Self-signed webhook certificate renewal when another replica renews first: the API server
answers this replica's guarded update with 409 Conflict, and the replica serves the winner's
pair instead of overwriting it.

kmock keeps one resourceVersion and applies every write, even one a reaction answers: the 409
reaction here is told to answer, and puts back what a refusing API server would have kept."""

from __future__ import annotations

import asyncio
import base64
import datetime
from pathlib import Path
from typing import Any

import pytest
from kvoffload_operator import certs, webhook_tls
from kvoffload_operator.k8s import KubeApi, make_api_client
from kvoffload_operator.settings import OperatorConfig

from tests.operator.test_security_operator import MWC, SECRETS, declare_webhook_config, secret_data

SECRET = "kvoffload-webhook-tls"
SECRET_URL = f"patch /api/v1/namespaces/default/secrets/{SECRET}"
CONFLICT = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict"}
NAMES = certs.service_dns_names("kvoffload-webhook", "default")


def _encoded(bundle: certs.CertBundle) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in bundle.secret_data().items()}


def _store_due_pair(kmock: Any) -> certs.CertBundle:
    """A pair whose certificate expires in 5 days (inside the 30-day renewal window)."""
    declare_webhook_config(kmock)
    res = kmock.resources[SECRETS]
    res.kind, res.namespaced, res.verbs = "Secret", True, {"get", "patch", "create"}
    issued = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        days=certs.CERT_DAYS - 5
    )
    old = certs.generate(NAMES, now=issued)
    kmock.objects[SECRETS, "default", SECRET] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": "default", "resourceVersion": "7"},
        "data": _encoded(old),
    }
    return old


def _config(tmp_path: Path) -> OperatorConfig:
    return OperatorConfig(self_signed_certs=True, cert_dir=tmp_path / "certs")


async def test_a_replica_that_loses_the_renewal_race_serves_the_winners_pair(
    kmock: Any, tmp_path: Path
) -> None:
    old = _store_due_pair(kmock)
    winner = certs.renew(old, NAMES)

    def refused_since_another_replica_renewed_first() -> None:
        kmock.objects[SECRETS, "default", SECRET].patch({"data": _encoded(winner)})

    conflict = kmock[SECRET_URL][:1] << refused_since_another_replica_renewed_first << 409
    conflict = conflict << CONFLICT
    api = KubeApi(make_api_client(str(kmock.url)))

    served = await asyncio.to_thread(webhook_tls.ensure, api, _config(tmp_path))

    # this replica tried its own renewal once, guarded by the version it read, and lost
    assert len(conflict) == 1
    assert conflict[0].data["metadata"]["resourceVersion"] == "7"
    assert conflict[0].data["data"]["tls.crt"] != _encoded(winner)["tls.crt"]
    # it then serves the winner's pair, which the Secret still holds (not overwritten)
    assert served.bundle == winner
    assert served.cert.read_bytes() == winner.cert_pem
    assert served.key.read_bytes() == winner.key_pem
    assert secret_data(kmock) == winner.secret_data()
    # one CA all along: the caBundle is the CA both pairs chain to
    webhook = kmock.objects[MWC, None, "kvoffload-webhook"].raw["webhooks"][0]
    assert base64.b64decode(webhook["clientConfig"]["caBundle"]) == old.ca_pem == winner.ca_pem
    assert certs.issued_by(served.bundle.cert_pem, old.ca_pem)
    assert certs.still_valid(served.bundle.cert_pem, NAMES, min_days=30)


async def test_a_replica_that_always_loses_gives_up_after_its_attempts(
    kmock: Any, tmp_path: Path
) -> None:
    """Every update refused and the Secret never usable: a bounded retry and an error (which
    refresh_forever logs and retries next round, still serving the valid pair it has)."""
    old = _store_due_pair(kmock)

    def refused() -> None:
        kmock.objects[SECRETS, "default", SECRET].patch({"data": _encoded(old)})

    conflicts = kmock[SECRET_URL] << refused << 409 << CONFLICT
    api = KubeApi(make_api_client(str(kmock.url)))

    with pytest.raises(RuntimeError, match="no stable webhook certificate after 8 tries"):
        await asyncio.to_thread(webhook_tls.shared_bundle, api, _config(tmp_path))

    assert len(conflicts) == webhook_tls.ATTEMPTS
    assert secret_data(kmock) == old.secret_data()
