"""One self-signed webhook certificate for every operator replica (``--self-signed-certs``).

Replicas agree through the API server, not a timer: the pair lives in one Secret and the first
writer wins.
- no Secret: each replica that finds none generates a CA and pair and *creates* the Secret; the
  API server accepts one create, the others get 409 and re-read the winner's pair;
- a Secret without a usable pair (the chart's empty one from an older release): filled by an
  update guarded by its ``resourceVersion``; a replica that lost the race gets 409 and re-reads;
- a serving certificate due for renewal: a new one signed by the *same* CA (its key is kept in
  the Secret), written the same guarded way. Both certificates chain to the one caBundle, so a
  replica still serving the old one for a moment is trusted all along.
Every replica then serves what the Secret holds and patches the webhook configurations'
caBundle with its CA (a no-op when already set). `refresh_forever` repeats this every
``cert_check_interval`` seconds and rewrites the served files when the pair changed; kopf's
server reloads changed files without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload_operator import certs
from kvoffload_operator.settings import OperatorConfig

log = logging.getLogger(__name__)
ATTEMPTS = 8


@dataclass(frozen=True)
class Served:
    bundle: certs.CertBundle
    cert: Path
    key: Path


def _usable(bundle: certs.CertBundle | None, names: list[str], renew_days: int) -> bool:
    return (
        bundle is not None
        and certs.still_valid(bundle.cert_pem, names, min_days=renew_days)
        and certs.issued_by(bundle.cert_pem, bundle.ca_pem)
    )


def shared_bundle(api: Any, config: OperatorConfig) -> certs.CertBundle:
    """The pair in ``config.cert_secret``, made, completed or renewed there first if needed."""
    ns, name = config.pod_namespace, config.cert_secret
    names = certs.service_dns_names(config.service, ns)
    for _ in range(ATTEMPTS):
        found = api.read_secret_versioned(ns, name)
        if found is None:
            bundle = certs.generate(names)
            owner = api.webhook_owner(config.webhook_config)
            if api.create_secret(
                ns, name, bundle.secret_data(), type_="kubernetes.io/tls", owner=owner
            ):
                log.info("kvoffload: generated the webhook certificate for %s", names[2])
                return bundle
            continue  # another replica created it first: use theirs
        data, version = found
        stored = certs.CertBundle.from_secret(data)
        if _usable(stored, names, config.cert_renew_days):
            assert stored is not None
            return stored
        bundle = certs.renew(stored, names) if stored is not None else certs.generate(names)
        if api.replace_secret_data(ns, name, bundle.secret_data(), version):
            log.info(
                "kvoffload: %s the webhook certificate in secret %s",
                "renewed" if stored is not None else "generated",
                name,
            )
            return bundle
    raise RuntimeError(f"secret {ns}/{name}: no stable webhook certificate after {ATTEMPTS} tries")


def publish(api: Any, config: OperatorConfig, bundle: certs.CertBundle) -> None:
    """The CA into the caBundle of the chart's webhook configurations."""
    api.patch_webhook_ca(config.webhook_config, bundle.ca_pem)
    if config.policy_webhook_config:
        api.patch_webhook_ca(config.policy_webhook_config, bundle.ca_pem, validating=True)


def ensure(api: Any, config: OperatorConfig) -> Served:
    """The shared pair, published and written to ``cert_dir`` for the server."""
    bundle = shared_bundle(api, config)
    publish(api, config, bundle)
    cert, key = bundle.write(config.cert_dir)
    return Served(bundle, cert, key)


async def refresh_forever(api: Any, config: OperatorConfig, served: Served) -> None:
    """Re-check the pair every ``cert_check_interval`` s; serve a changed or renewed one."""
    current = served.bundle
    while True:
        await asyncio.sleep(config.cert_check_interval)
        try:
            bundle = await asyncio.to_thread(shared_bundle, api, config)
            await asyncio.to_thread(publish, api, config, bundle)
        except Exception as exc:  # retried next round; the served pair stays valid meanwhile
            log.warning("kvoffload: webhook certificate check failed: %s", exc)
            continue
        if bundle != current:
            bundle.write(config.cert_dir)
            current = bundle
            log.info("kvoffload: serving the webhook certificate now stored in the secret")
