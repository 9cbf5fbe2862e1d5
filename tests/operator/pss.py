"""Pod Security Standards "restricted" (Kubernetes v1.33 checks), from the spec's field list.

https://kubernetes.io/docs/concepts/security/pod-security-standards/ : every baseline and
restricted control that reads a pod spec. Returns the violations, empty when the pod passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
BASELINE_CAPS = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    out: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"spec.{key}")
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            out.append(f"volume {v['name']}: hostPath")
        if kinds - RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: type {sorted(kinds)} not allowed")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {s.get('name')}")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod hostProcess")
    if (psc.get("seLinuxOptions") or {}).get("type", "") not in SELINUX_TYPES:
        out.append("pod seLinuxOptions.type")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        out.append("pod seccomp Unconfined")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("pod appArmor Unconfined")
    containers = [
        *(spec.get("initContainers") or []),
        *(spec.get("containers") or []),
        *(spec.get("ephemeralContainers") or []),
    ]
    for c in containers:
        out += [f"{c.get('name')}: {v}" for v in _container(c, psc, pod_seccomp)]
    return out


def _container(c: Mapping[str, Any], psc: Mapping[str, Any], pod_seccomp: Any) -> list[str]:
    sc = c.get("securityContext") or {}
    out = []
    if sc.get("privileged"):
        out.append("privileged")
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess")
    if any(p.get("hostPort") for p in c.get("ports") or []):
        out.append("hostPort")
    if sc.get("procMount", "Default") != "Default":
        out.append("procMount")
    if (sc.get("seLinuxOptions") or {}).get("type", "") not in SELINUX_TYPES:
        out.append("seLinuxOptions.type")
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("appArmor Unconfined")
    caps = sc.get("capabilities") or {}
    added = set(caps.get("add") or ())
    if added - BASELINE_CAPS:
        out.append(f"capabilities.add {sorted(added - BASELINE_CAPS)} (baseline)")
    if added - {"NET_BIND_SERVICE"}:
        out.append(f"capabilities.add {sorted(added)} (restricted: only NET_BIND_SERVICE)")
    if "ALL" not in (caps.get("drop") or ()):
        out.append("capabilities.drop must include ALL")
    if sc.get("allowPrivilegeEscalation") is not False:
        out.append("allowPrivilegeEscalation must be false")
    if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
        out.append("runAsNonRoot must be true")
    if sc.get("runAsUser") == 0:
        out.append("runAsUser 0")
    seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
    if seccomp not in ("RuntimeDefault", "Localhost"):
        out.append(f"seccompProfile {seccomp!r}: must be RuntimeDefault or Localhost")
    return out
