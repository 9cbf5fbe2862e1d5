"""kopf handlers: thin wrappers over the pure core, registered on a given registry.

- index ``policy_index``: namespace → parsed policies (the webhook reads it, no API call);
- ``mutate-pods``: the admission webhook (`admission.admit_pod`, the CLI's code path);
- reconcile on create/update/resume: rollouts (template hash) + status;
- timer: status refresh (matched/injected/skipped pods, sidecar readiness, ``Degraded``) and a
  Warning Event on each degraded injected pod, once per pod and reason: a failing kvoffload
  container, or what its sidecar answers over ``Stats`` on the pod's port 9400 (a pool it cannot
  build, a disabled connector; `sidecar_stats`, bounded by ``--sidecar-stats-timeout``); for a
  placement-node policy, the KVOffloadNodePool it names (its grant, the tenant's shared
  capacity; the status entries of nodes that no longer exist removed from it);
- startup, with ``--agent-daemonset``: the node agents' in-place upgrade (`agent_upgrader`).
No delete handler: deleting a policy leaves running pods alone; the index drops it as
soon as the policy is marked for deletion (not when its finalizer is released), so injection
stops at once. (The timer makes kopf hold a finalizer while the operator runs: uninstall
policies before the operator, see the chart's NOTES.)
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf

from kvoffload_operator import agent_upgrader, hashseed, webhook_tls
from kvoffload_operator.admission import admit_pod
from kvoffload_operator.guardrails import NOT_ALLOWED
from kvoffload_operator.inject import decide
from kvoffload_operator.k8s import ApiError
from kvoffload_operator.node_pool import STALE_AFTER_S, NodePoolRead, prune_patch, stale_nodes
from kvoffload_operator.policy import (
    API_GROUP,
    API_VERSION,
    PLURAL,
    Policy,
    PolicyError,
    policy_from_resource,
)
from kvoffload_operator.settings import OperatorConfig, configure
from kvoffload_operator.sidecar_reports import SidecarReport
from kvoffload_operator.sidecar_stats import GrpcStatsSource, probe_sidecars
from kvoffload_operator.status import (
    ContainerProblem,
    build_status,
    degraded_problems,
    event_for,
    injected_pods,
    invalid_status,
)
from kvoffload_operator.webhook import PodWebhookServer
from kvoffload_operator.workloads import ROLLOUT_KINDS, hash_patch, template_hash

POLICIES = (API_GROUP, API_VERSION, PLURAL)
log = logging.getLogger(__name__)
CERT_FILE_CHECK_S = 60.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _namespace_policies(index: Any, namespace: str, fresh: Policy | None = None) -> list[Policy]:
    policies = list(index.get(namespace, [])) if index is not None else []
    if fresh is not None:
        policies = [p for p in policies if p.name != fresh.name] + [fresh]
    return policies


def plan_rollouts(
    policy: Policy, workloads: list[Mapping[str, Any]], namespace_policies: list[Policy]
) -> list[Mapping[str, Any]]:
    """Workloads whose new pods this policy would inject and whose template lacks its hash."""
    out = []
    for obj in workloads:
        if obj.get("kind") not in ROLLOUT_KINDS or template_hash(obj) == policy.spec_hash:
            continue
        decision = decide(obj.get("spec", {}).get("template") or {}, namespace_policies)
        if decision.inject and decision.policy is not None and decision.policy.name == policy.name:
            out.append(obj)
    return out


def _refresh_status(
    policy: Policy, memo: Any, index: Any, status: Mapping[str, Any], patch: kopf.Patch
) -> None:
    api = memo.api
    enabled = memo.config.injection_enabled(api.namespace_labels(policy.namespace))
    try:
        pods = api.list_pods(policy.namespace, policy.selector.to_query())
        visible = True
    except ApiError as exc:  # no RoleBinding in this namespace (the chart's rbac.namespaces)
        if exc.status != 403:
            raise
        pods, visible = [], False
    mine = injected_pods(policy, pods)
    # placement node: no sidecar in the pods (the NodePlacement condition says so), but the
    # kubelet's FailedMount events name pods that no node agent lets start
    reports = [] if policy.pool.node else _ask_sidecars(mine, memo)
    events = _failed_mounts(policy, mine, memo)
    node_pool = _read_node_pool(policy, memo)
    new = build_status(
        policy,
        pods,
        _namespace_policies(index, policy.namespace, policy),
        namespace_enabled=enabled,
        now=_now(),
        previous=status,
        reports=reports,
        pods_visible=visible,
        events=events,
        node_pool=node_pool,
    )
    sent = memo.setdefault("sent_status", {})
    key = (policy.namespace, policy.name)
    if {k: status.get(k) for k in new} != new:
        patch.status.update(status_patch(status, new, sent.get(key, {})))
        sent[key] = new
    _report_problems(
        degraded_problems(mine, reports, node=policy.pool.node, events=events, node_pool=node_pool),
        memo,
    )


def _read_node_pool(policy: Policy, memo: Any) -> NodePoolRead | None:
    """The KVOffloadNodePool a node policy names, read by name at each refresh (the chart's
    ClusterRole grants get on kvoffloadnodepools); unreadable says why instead."""
    if not policy.pool.node or not policy.pool.node_pool or not policy.pool.tenant:
        return None
    named = {"name": policy.pool.node_pool, "tenant": policy.pool.tenant,
             "namespace": policy.namespace}  # fmt: skip
    try:
        obj = memo.api.get_node_pool(policy.pool.node_pool)
    except ApiError as exc:
        why = f"{exc.status} {exc.reason}"
        if exc.status == 403:
            why += " (the operator's ClusterRole lacks get on kvoffloadnodepools)"
        return NodePoolRead(**named, readable=False, error=why)
    if obj is not None:
        obj = _prune_gone_nodes(policy.pool.node_pool, obj, memo)
    return NodePoolRead(**named, obj=obj)


def _prune_gone_nodes(name: str, obj: dict[str, Any], memo: Any) -> dict[str, Any]:
    """Remove the pool's ``status.nodes`` entries of nodes that no longer exist (their agent
    is gone with them: nobody else rewrites them); returns ``obj`` without them. Only entries
    no agent wrote for `node_pool.STALE_AFTER_S` are looked up, a node found to exist again at
    most once per that period; the patch is conditioned on the resourceVersion read. Any API
    error leaves the entries for a later refresh."""
    checked: dict[str, float] = memo.setdefault("nodes_seen", {})
    now, clock = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    gone = []
    try:
        for node in stale_nodes(obj, now):
            if clock - checked.get(node, -STALE_AFTER_S) < STALE_AFTER_S:
                continue
            if memo.api.node_exists(node):
                checked[node] = clock
            else:
                gone.append(node)
        if gone:
            memo.api.patch_node_pool_status(name, prune_patch(obj, gone))
    except ApiError as exc:  # 403 (no RBAC for nodes), 409 (an agent wrote): not this time
        log.info("kvoffload: node pool %s: entries of gone nodes not pruned: %s %s", name,
                 exc.status, exc.reason)  # fmt: skip
        return obj
    if not gone:
        return obj
    nodes = {k: v for k, v in obj["status"]["nodes"].items() if k not in gone}
    return {**obj, "status": {**obj["status"], "nodes": nodes}}


def _failed_mounts(policy: Policy, mine: list[Mapping[str, Any]], memo: Any) -> list[Any]:
    """The namespace's FailedMount events, for a node policy with a pod still Pending on a
    node (none otherwise: nothing to read). Without the right to list events (a Role that
    lacks it) there are none here; the pods' own events still say it."""
    if not policy.pool.node or not any(
        (p.get("status") or {}).get("phase") in (None, "Pending")
        and (p.get("spec") or {}).get("nodeName")
        for p in mine
    ):
        return []
    try:
        return memo.api.list_failed_mounts(policy.namespace)
    except ApiError as exc:
        if exc.status != 403:
            raise
        return []


def _ask_sidecars(mine: list[Mapping[str, Any]], memo: Any) -> list[SidecarReport]:
    """The sidecars' Stats (``memo.stats_source`` in tests); none when turned off."""
    timeout = memo.config.sidecar_stats_timeout
    if timeout <= 0:
        return []
    source = memo.get("stats_source") or GrpcStatsSource()
    return probe_sidecars(mine, source, timeout=timeout, budget=max(5 * timeout, timeout + 1))


def status_patch(
    old: Mapping[str, Any], new: Mapping[str, Any], sent: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``new`` as a merge patch over ``old``: keys gone from a map (``skipped``,
    ``degradedReasons``) are sent as null, or the API server would keep them. ``sent`` is the
    status this operator patched last: a timer may fire before the watch brings that patch
    back, and ``old`` (the body it was given) would then lack keys that the stored status has."""
    out = dict(new)
    for key, value in new.items():
        if not isinstance(value, dict) or key == "conditions":
            continue
        before = [m for src in (old, sent or {}) if isinstance(m := src.get(key), Mapping)]
        gone = {k: None for m in before for k in m if k not in value}
        out[key] = {**gone, **value}
    return out


def _report_problems(problems: list[ContainerProblem], memo: Any) -> None:
    """One Warning Event per pod, container and reason (per operator process): the pod's own
    events say the pull failed; ours says it is kvoffload's and what the pod loses."""
    reported: set[tuple[str, str, str]] = memo.setdefault("reported_problems", set())
    # reconcile and the timer may refresh one policy at once, each in a thread of kopf's pool:
    # the first to claim a problem posts it
    lock: threading.Lock = memo.setdefault("reported_lock", threading.Lock())
    for p in problems:
        with lock:
            if p.key in reported:
                continue
            reported.add(p.key)
        reason, message = event_for(p)
        try:
            memo.api.post_pod_event(
                p.namespace, p.pod, p.uid, p.field_path, reason, message, _now()
            )
        except BaseException:
            with lock:
                reported.discard(p.key)  # posted at the next refresh
            raise


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler on ``registry`` (tests use their own registry and config)."""

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Any, logger: Any, **_: Any) -> None:
        configure(settings, config)
        if config.agent_daemonset:  # the node agents' in-place upgrade (`agent_upgrader`)
            memo.agent_upgrader = asyncio.create_task(
                agent_upgrader.upgrade_forever(memo.api, config)
            )
        if config.webhook_port:
            if config.self_signed_certs:
                served = await asyncio.to_thread(webhook_tls.ensure, memo.api, config)
                cert, key = served.cert, served.key
                memo.cert_refresher = asyncio.create_task(
                    webhook_tls.refresh_forever(memo.api, config, served)
                )
            else:
                cert, key = config.cert_dir / "tls.crt", config.cert_dir / "tls.key"
            settings.admission.server = PodWebhookServer(
                addr=config.webhook_addr,
                port=config.webhook_port,
                certfile=str(cert),
                pkeyfile=str(key),
                # a renewed pair (ours, another replica's, cert-manager's) is served this soon
                file_check_interval=CERT_FILE_CHECK_S,
            )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        for name in ("cert_refresher", "agent_upgrader"):
            task = memo.get(name)
            if task is not None:
                task.cancel()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if config.api_server:
            return kopf.ConnectionInfo(server=config.api_server.rstrip("/"))
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.index(*POLICIES, id="policy_index", registry=registry)
    def policy_index(body: Any, namespace: str, logger: Any, **_: Any) -> dict[str, Policy]:
        if body.get("metadata", {}).get("deletionTimestamp"):
            return {}  # being deleted: new pods must not get it while kopf releases it
        try:
            policy = policy_from_resource(body)
        except PolicyError as exc:
            logger.warning("kvoffload: policy ignored by the webhook: %s", exc)
            return {}
        refused = guardrails.message(policy)
        if refused:  # got in before the validating webhook (or past it): never injected
            logger.warning("kvoffload: policy ignored by the webhook: %s", refused)
            return {}
        return {namespace: policy}

    guardrails = config.guardrails()
    if config.webhook_port:  # --webhook-port=0: a controller without a webhook server
        _register_webhook(registry, config)

    @kopf.on.resume(*POLICIES, id="reconcile", registry=registry)
    @kopf.on.create(*POLICIES, id="reconcile", registry=registry)
    @kopf.on.update(*POLICIES, id="reconcile", field="spec", registry=registry)
    def reconcile(
        body: Any,
        status: Any,
        patch: kopf.Patch,
        memo: Any,
        policy_index: Any,
        logger: Any,
        **_: Any,
    ) -> None:
        generation = body["metadata"].get("generation", 1)
        try:
            policy = policy_from_resource(body)
        except PolicyError as exc:
            patch.status.update(invalid_status(generation, str(exc), _now(), status))
            memo.metrics.reconciles.labels(result="invalid").inc()
            return
        refused = guardrails.message(policy)
        if refused:
            patch.status.update(
                invalid_status(generation, refused, _now(), status, reason=NOT_ALLOWED)
            )
            memo.metrics.reconciles.labels(result="invalid").inc()
            logger.warning("kvoffload: policy not allowed, never injected: %s", refused)
            return
        try:
            _ensure_seed(policy, body["metadata"].get("uid"), memo, logger)
            _apply(policy, memo, policy_index, status, patch, logger)
        except ApiError as exc:  # retried by kopf; counted here
            memo.metrics.reconciles.labels(result="error").inc()
            raise kopf.TemporaryError(f"API error: {exc.status} {exc.reason}", delay=30) from exc
        memo.metrics.reconciles.labels(result="success").inc()

    def _apply(
        policy: Policy, memo: Any, policy_index: Any, status: Any, patch: kopf.Patch, logger: Any
    ) -> None:
        api = memo.api
        enabled = config.injection_enabled(api.namespace_labels(policy.namespace))
        if policy.rollout_enabled and enabled and not config.rollouts:
            logger.info(
                "kvoffload: policy asks for rollouts; the operator runs without --rollouts "
                "(helm value operator.rollouts.enabled), so workloads roll when their owners "
                "restart them"
            )
        if policy.rollout_enabled and enabled and config.rollouts:
            peers = _namespace_policies(policy_index, policy.namespace, policy)
            for obj in plan_rollouts(policy, api.list_workloads(policy.namespace), peers):
                meta = obj["metadata"]
                api.patch_workload(
                    obj["kind"], policy.namespace, meta["name"], hash_patch(policy.spec_hash)
                )
                memo.metrics.rollouts.labels(kind=obj["kind"]).inc()
                logger.info(
                    "kvoffload: rolling %s %s for policy hash %s",
                    obj["kind"],
                    meta["name"],
                    policy.spec_hash,
                )
        _refresh_status(policy, memo, policy_index, status, patch)

    @kopf.timer(*POLICIES, id="refresh-status", interval=config.status_interval, registry=registry)
    def refresh(
        body: Any, status: Any, patch: kopf.Patch, memo: Any, policy_index: Any, **_: Any
    ) -> None:
        try:
            policy = policy_from_resource(body)
        except PolicyError:
            return  # reconcile() already reported it
        if guardrails.problems(policy):
            return  # likewise
        _refresh_status(policy, memo, policy_index, status, patch)

    if config.webhook_port:

        @kopf.on.validate(
            *POLICIES, id="validate-policies", operations={"CREATE", "UPDATE"}, registry=registry
        )
        def validate_policies(body: Any, **_: Any) -> None:
            """Refuse at apply what the cluster admin does not allow (`guardrails`), and what the
            CRD's schema would refuse (the same checks, for a CRD applied without them)."""
            try:
                policy = policy_from_resource(body)
            except PolicyError as exc:
                raise kopf.AdmissionError(f"kvoffload: {exc}", code=422) from None
            refused = guardrails.message(policy)
            if refused:
                raise kopf.AdmissionError(f"kvoffload: policy not allowed: {refused}", code=403)


def _register_webhook(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    @kopf.on.mutate("pods", id="mutate-pods", operations={"CREATE"}, registry=registry)
    def mutate_pods(
        body: Any, patch: kopf.Patch, warnings: list[str], memo: Any, policy_index: Any, **_: Any
    ) -> None:
        # kopf turns a handler exception into a denial: nothing may escape (never block pods).
        try:
            pod = dict(body)
            namespace = (pod.get("metadata") or {}).get("namespace") or ""
            # a policy selects pods of its own namespace only (the index is keyed by it; the
            # filter keeps that true whatever the index holds)
            policies = [
                p for p in _namespace_policies(policy_index, namespace) if p.namespace == namespace
            ]
        except Exception as exc:
            warnings.append(f"kvoffload: injection failed, pod admitted unchanged: {exc}")
            return
        result = admit_pod(pod, policies, config.render_defaults(), memo.metrics)
        warnings.extend(result.warnings)
        if result.pod != pod:
            mutated = result.pod

            def replace(target: dict[str, Any]) -> None:
                target.clear()
                target.update(mutated)

            patch.fns.append(replace)


def _ensure_seed(policy: Policy, uid: str | None, memo: Any, logger: Any) -> None:
    """The policy's hash-seed Secret (`hashseed`), created once; kept as it is when it exists
    (pods already started with it). Without the right to create it here (no RoleBinding in this
    namespace) the pods' optional reference stays empty: logged once, ``Limited`` on status."""
    created: set[tuple[str, str]] = memo.setdefault("seeds", set())
    key = (policy.namespace, policy.name)
    if key in created:
        return
    try:
        memo.api.create_secret(
            policy.namespace,
            hashseed.secret_name(policy.name),
            {hashseed.KEY: hashseed.new_seed()},
            labels={hashseed.LABEL: policy.name[:63]},
            # deleted with its policy (whose pods then get no new injection anyway)
            owner={
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": "KVOffloadPolicy",
                "name": policy.name,
                "uid": uid,
            }
            if uid
            else None,
        )
    except ApiError as exc:
        if exc.status != 403:
            raise
        logger.warning(
            "kvoffload: cannot create the hash-seed secret %s in namespace %s (not in the chart's "
            "rbac.namespaces?): its pods run with per-process seeds (hits last one engine's life)",
            hashseed.secret_name(policy.name),
            policy.namespace,
        )
    created.add(key)
