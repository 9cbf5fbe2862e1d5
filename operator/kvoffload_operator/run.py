"""Start the operator: kopf, the webhook, metrics and health (needs the ``operator`` extra)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import kopf
import prometheus_client

from kvoffload_operator.handlers import register
from kvoffload_operator.k8s import KubeApi, make_api_client
from kvoffload_operator.metrics import OperatorMetrics
from kvoffload_operator.settings import VERSION, parse_operator_args


def run_operator(argv: Sequence[str]) -> int:
    """Run until stopped; argv as `kvoffload operator` takes it."""
    config = parse_operator_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    registry = kopf.OperatorRegistry()
    register(registry, config)
    metrics = OperatorMetrics.create(version=VERSION)
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port, registry=metrics.registry)
    memo = kopf.Memo(
        config=config, metrics=metrics, api=KubeApi(make_api_client(config.api_server))
    )
    liveness = f"http://0.0.0.0:{config.health_port}/healthz" if config.health_port else None
    asyncio.run(
        kopf.operator(
            registry=registry,
            memo=memo,
            clusterwide=config.namespace is None,
            namespaces=[config.namespace] if config.namespace else (),
            standalone=config.standalone,
            peering_name=config.peering,
            priority=config.priority,
            liveness_endpoint=liveness,
        )
    )
    return 0
