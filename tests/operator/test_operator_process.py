"""`kvoffload operator` as a real process (the console script) against the kmock emulator:
flags → kopf, the HTTPS webhook, Prometheus /metrics and kopf's /healthz all come up, and
SIGTERM stops it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kvoffload_operator import certs

from tests.operator.harness import (
    POLICIES,
    admission_review,
    declare_resources,
    decoded_patch,
    eventually,
    free_port,
    put,
)
from tests.operator.test_operator_kmock import policy

pytestmark = pytest.mark.process


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


async def test_console_script_serves_webhook_metrics_health(kmock: Any, tmp_path: Path) -> None:
    declare_resources(kmock)
    put(kmock, POLICIES, policy("cache"))
    certs.generate(["localhost"], ("127.0.0.1",)).write(tmp_path)
    port, metrics, health = free_port(), free_port(), free_port()
    exe = Path(sys.executable).with_name("kvoffload")
    log = tmp_path / "operator.log"  # a file, not a pipe nobody drains
    err = log.open("w")
    env = {**os.environ, "KVOFFLOAD_OPERATOR_METRICS_PORT": str(metrics)}  # env form of a flag
    proc = subprocess.Popen(
        [
            str(exe),
            "operator",
            "--api-server",
            str(kmock.url),
            "--standalone",
            "--webhook-port",
            str(port),
            "--webhook-addr",
            "127.0.0.1",
            "--cert-dir",
            str(tmp_path),
            "--health-port",
            str(health),
            "--log-level",
            "WARNING",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        new_pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v1"}]},
        }

        async def injected() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"operator exited: {log.read_text()[-4000:]}")
            try:
                return bool(
                    decoded_patch(
                        await asyncio.to_thread(
                            admission_review, port, tmp_path / "ca.crt", new_pod, "team"
                        )
                    )
                )
            except OSError:
                return False

        await eventually(injected, timeout=30)
        scrape = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics}/metrics")
        assert 'kvoffload_injections_total{outcome="injected",reason="none"}' in scrape
        assert "kvoffload_injection_duration_seconds_bucket" in scrape
        assert await asyncio.to_thread(_get, f"http://127.0.0.1:{health}/healthz")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:  # wait off the loop: kmock runs on it and the operator talks to it while stopping
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
            print(log.read_text()[-6000:])
            raise
        finally:
            err.close()
    assert proc.returncode == 0, log.read_text()[-4000:]
