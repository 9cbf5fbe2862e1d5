"""Operator configuration (`OperatorConfig`) and the kopf settings applied at startup.

Replicas and peering — what the chart follows:
- ``replicas: 1`` (the default): run with ``--standalone``; no peering objects or RBAC needed.
  The webhook has ``failurePolicy: Ignore``, so a restarting operator never blocks pods.
- ``replicas > 1``: omit ``--standalone``. The chart then installs kopf's peering CRDs
  (``kopf.dev`` ``ClusterKopfPeering`` and ``KopfPeering``) and one peering object named
  ``--peering`` (default ``kvoffload``): a ``ClusterKopfPeering`` when the operator watches all
  namespaces, a ``KopfPeering`` in the watched namespace otherwise, plus RBAC get/list/watch/patch
  on it. Each replica gets a random ``--priority`` (peering pauses lower priorities; equal ones
  would all pause). Only the highest replica reconciles policies; every replica serves the
  webhook (kopf does not pause its admission server), which is what makes replicas useful.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import kopf

from kvoffload_operator.guardrails import Guardrails
from kvoffload_operator.inject import RenderDefaults
from kvoffload_operator.version import VERSION

__all__ = ["VERSION", "OperatorConfig", "configure", "parse_operator_args"]
ENV_PREFIX = "KVOFFLOAD_OPERATOR_"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorConfig:
    namespace: str | None = None
    """Watch only this namespace (policies, pods, workloads); None: all namespaces."""
    webhook_port: int = 9443
    """HTTPS port of the admission server (path ``/mutate-pods``); 0 runs no webhook server."""
    webhook_addr: str = "0.0.0.0"
    """Address the admission server binds."""
    cert_dir: Path = Path("/etc/kvoffload/webhook-certs")
    """Holds ``tls.crt``/``tls.key`` (cert-manager Secret mount); with ``self_signed_certs``
    the operator writes them here, so it must then be writable (an emptyDir)."""
    self_signed_certs: bool = False
    """Generate a CA + serving certificate for ``<service>.<pod_namespace>.svc`` (or reuse the
    one in ``cert_secret`` while valid), store it in that Secret and patch the ``caBundle`` of
    ``webhook_config``. Replicas share the Secret, so they serve the same certificate."""
    cert_secret: str = "kvoffload-webhook-tls"
    """Secret (in ``pod_namespace``) that holds the self-signed pair."""
    webhook_config: str = "kvoffload-webhook"
    """MutatingWebhookConfiguration (shipped by the chart) whose caBundle is patched."""
    service: str = "kvoffload-webhook"
    """The webhook Service's name (the certificate's DNS names derive from it)."""
    pod_namespace: str = "default"
    """The operator's own namespace (env POD_NAMESPACE)."""
    sidecar_image: str = f"ghcr.io/kvoffload/kvoffload:{VERSION}"
    """Sidecar image for policies that name none."""
    connector_image: str = f"ghcr.io/kvoffload/kvoffload-connector:{VERSION}"
    """Connector payload image for initContainer delivery when a policy names none."""
    metrics_port: int = 8080
    """Prometheus /metrics port; 0 disables."""
    health_port: int = 8081
    """kopf liveness endpoint ``/healthz`` port; 0 disables."""
    log_level: str = "INFO"
    """Python log level."""
    standalone: bool = False
    """No peering (one replica); see the module doc."""
    peering: str = "kvoffload"
    """Name of the kopf peering object (several replicas)."""
    priority: int = 0
    """Peering priority; 0 means a random one in [1, 10000) so replicas differ."""
    status_interval: float = 30.0
    """Seconds between policy status refreshes (matched/injected pods, sidecar readiness)."""
    sidecar_stats_timeout: float = 2.0
    """Deadline (s) of each ``Stats`` call the status refresh makes to a running injected pod's
    sidecar (``podIP:9400``, 16 at a time, all within 5x this); 0 asks none. A sidecar that does
    not answer counts in ``unreachableSidecars`` only (NetworkPolicies may block the operator)."""
    api_server: str | None = None
    """Plain API URL without credentials (tests against the kmock emulator); None: in-cluster
    service account or kubeconfig."""
    injection_label: str = "kvoffload.io/injection=enabled"
    """The namespace label (key=value) the chart's webhook namespaceSelector requires. Policies
    in namespaces without it get Ready=False (InjectionDisabled) and roll no workloads. Empty
    string: no check (for a customised namespaceSelector)."""
    watch_timeout: int = 300
    """Server-side watch timeout (s): watches are re-established at least this often, so a
    silently dead connection cannot stall the operator (kopf's default is no timeout)."""
    rollouts: bool = False
    """Let policies with ``rollout.enabled`` roll the Deployments/StatefulSets they inject (a
    pod-template patch: code execution in that namespace). Off: the operator never writes a
    workload; the chart then grants no workload verb (helm value operator.rollouts.enabled)."""
    allowed_images: str = ""
    """Comma-separated images a policy may name (`guardrails`): repositories, ``prefix/``,
    ``repo@sha256:…`` or ``*``; the repositories of ``--sidecar-image``/``--connector-image``
    are always allowed."""
    allow_privileged: bool = False
    """Allow policies with ``spec.sidecar.securityProfile: privileged``."""
    allowed_capabilities: str = ""
    """Comma-separated ``spec.sidecar.extraCapabilities`` policies may add (e.g. IPC_LOCK)."""
    policy_webhook_config: str = ""
    """ValidatingWebhookConfiguration (shipped by the chart) whose caBundle is patched with the
    self-signed CA; empty: none."""
    cert_check_interval: float = 3600.0
    """Seconds between re-reads of the self-signed pair: a pair renewed by another replica, or
    due for renewal, is served without a restart."""
    cert_renew_days: int = 30
    """Renew the self-signed serving certificate this many days before it expires."""
    agent_daemonset: str = ""
    """The node agent DaemonSet (in ``pod_namespace``) whose pods' ``agent`` container the
    operator upgrades in place (`agent_upgrade`); empty: none (helm value nodeAgent.upgrade)."""
    agent_upgrade_interval: float = 10.0
    """Seconds between checks of that DaemonSet's agent image against its pods'."""
    agent_upgrade_timeout: float = 300.0
    """Seconds a patched agent pod has to run and be ready with the new image; past that the
    upgrade stops (a Warning Event) until it is."""

    def injection_enabled(self, labels: dict[str, str] | None) -> bool:
        """Whether a namespace with ``labels`` (None: unreadable) reaches the webhook."""
        if not self.injection_label:
            return True
        key, _, value = self.injection_label.partition("=")
        return labels is not None and labels.get(key) == value

    def guardrails(self) -> Guardrails:
        """What the admin lets policies ask for (`guardrails`)."""
        return Guardrails.of(
            self.allowed_images,
            self.allow_privileged,
            self.allowed_capabilities,
            defaults=(self.sidecar_image, self.connector_image),
        )

    def render_defaults(self) -> RenderDefaults:
        return RenderDefaults(self.sidecar_image, self.connector_image, VERSION)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_operator_args(
    argv: Sequence[str], environ: dict[str, str] | None = None
) -> OperatorConfig:
    """Flags, each also settable as env ``KVOFFLOAD_OPERATOR_<FLAG>`` (flags win)."""
    env = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(
        prog="kvoffload operator", description="Run the kvoffload operator and webhook."
    )
    defaults = OperatorConfig(pod_namespace=env.get("POD_NAMESPACE", "default"))
    for f in fields(OperatorConfig):
        default: Any = getattr(defaults, f.name)
        env_value = env.get(ENV_PREFIX + f.name.upper())
        if f.type in ("bool",):
            on = env_value is not None and env_value.lower() in ("1", "true", "yes")
            parser.add_argument(_flag(f.name), action="store_true", default=on or default)
            continue
        kind = {"int": int, "float": float, "Path": Path}.get(str(f.type), str)
        if env_value is not None:
            default = kind(env_value)
        parser.add_argument(_flag(f.name), type=kind, default=default)
    ns = parser.parse_args(list(argv))
    values = {f.name: getattr(ns, f.name) for f in fields(OperatorConfig)}
    if not values["priority"]:
        values["priority"] = random.randrange(1, 10000)
    return OperatorConfig(**values)


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """All kopf settings, in one place (called from the startup handler)."""
    # Watches stall silently without these (nolar/kopf#585): the server ends each watch after
    # watch_timeout, the client gives up a little later, and every API call has a deadline.
    settings.watching.server_timeout = config.watch_timeout
    settings.watching.client_timeout = config.watch_timeout + 30
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 30
    # Our own keys for kopf's bookkeeping; nothing in status (the schema would prune it).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvoffload.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvoffload.io", key="last-handled-configuration"
    )
    settings.persistence.finalizer = "kvoffload.io/finalizer"
    settings.posting.level = logging.WARNING
    settings.peering.name = config.peering
    settings.peering.priority = config.priority
    settings.peering.standalone = config.standalone
    settings.peering.mandatory = False
    settings.peering.clusterwide = config.namespace is None
    # The chart ships the MutatingWebhookConfiguration (namespace opt-in, Ignore, IfNeeded).
    settings.admission.managed = None
    settings.admission.server = None
