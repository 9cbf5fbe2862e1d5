"""Run a (kvoffload-injected) pod the way the kubelet would, as real processes on this box.

Why: the injection is only right if the pod it produces starts and serves as the same pod without
kvoffload does: real uids, real size-limited emptyDirs, the real startup-probe gate, the real
vLLM entrypoint. The harness reads whatever the manifest says; it knows no injection details.

- **Pod sandbox**: a "pause" process `unshare --mount --net --propagation private sleep infinity`;
  every mount and container process enters it (`nsenter -t PAUSE -m -n`). Each pod thus gets its
  own `/kvoffload/...` paths, its own `/tmp` (a tmpfs) and its own loopback network (ports as the
  manifest says, no clashes with other tests) with the pod IP (`pod_translate.POD_IP`) on it.
  All containers of a pod share this one mount namespace: each emptyDir is mounted once, at its
  mountPath, which must agree between the containers that mount it (checked); `readOnly` and
  `subPath` are not emulated.
- **Volumes**: every `emptyDir` is a real tmpfs, `size=<sizeLimit>` (default 1Gi), `mode=0777`.
  A CSI inline volume of a driver the pod is given (`csi=[CsiDriver(...)]`, a CSIDriver with
  `podInfoOnMount: true`) is published as the kubelet's CSI part does it: NodePublishVolume on
  the plugin's socket for `<pods dir>/<pod uid>/volumes/kubernetes.io~csi/<volume>/mount`
  (the kubelet's volume handle, `csi-` + sha256 of pod uid and volume name), the volume's
  `volumeAttributes` with the pod's name, namespace, uid and service account and
  `csi.storage.k8s.io/ephemeral: "true"`, the pod's `fsGroup` as `volume_mount_group` when the
  plugin has that capability; the target is bind-mounted at each container's mountPath, and
  NodeUnpublishVolume is called once the pod's processes are gone. Other volume kinds (PVCs,
  Secrets, other drivers) are ignored. Mount points missing on the host are created and
  removed at stop.
- **Checkout reachability**: the images live in this checkout. When an ancestor of the checkout
  is not traversable by other uids (e.g. /root, mode 700), the pod's namespace gets a 0755 tmpfs
  over that ancestor with the checkout bind-mounted back at its own path.
- **Images** (`pod_images.py`): `kvoffload` images run from `.venv`; the connector image's
  `/payload` is bind-mounted at `/payload`; any other image is a stock vLLM (a venv without
  kvoffload) whose ENTRYPOINT is `vllm serve`.
- **Containers**: init containers in order; a native sidecar (`restartPolicy: Always`) starts and
  its startupProbe (exec; grpc as a health check to the pod IP) is polled like the
  kubelet does (periodSeconds, timeoutSeconds, failureThreshold; a failed probe restarts it, as
  the kubelet would) before the next container starts. Each runs via `setpriv --reuid --regid
  --groups` as its securityContext.runAsUser (pod's, else the image's USER: 65532 for
  kvoffload images, 1000 for vLLM), group runAsGroup (else the uid; `# harness-uid: U:G` in the
  manifest overrides, e.g. OpenShift's arbitrary uid with gid 0), supplementary groups the
  pod's `fsGroup` and `supplementalGroups` as the kubelet adds them (none: `--clear-groups`),
  env only from the manifest
  (literal values, `$(VAR)` in them, pod-field `fieldRef`s) plus PATH and HOME=/tmp.
  `restart_always(name)` restarts a container whenever it exits (restartPolicy Always);
  `restart(name)` stops one with a signal and starts it again (a liveness failure, a rollout of
  the same pod's process).
- **Memory limits**: kvoffload's own containers (sidecar, installer) run in a cgroup v1 memory
  cgroup of their own with `limit_in_bytes` = `resources.limits.memory`, where this box lets root
  make one: pages of a memory emptyDir are charged to the container that first touches them,
  so the sidecar's pre-faulted pool counts against its limit as under the kubelet (a too-small
  limit is an OOM kill, or the sidecar's own refusal). The same cgroup is kept across that
  container's restarts. vLLM's limits are not enforced (the CPU build's memory is not a GPU
  pod's).
- **vLLM container**: its argv translated by `pod_translate.py`; env adds
  `VLLM_CPU_KVCACHE_SPACE=1`, `VLLM_CPU_OMP_THREADS_BIND=nobind` (no pinning on a shared box),
  `OMP_NUM_THREADS=1`, `VLLM_SERVER_DEV_MODE=1` (for `/reset_prefix_cache`),
  `VLLM_RPC_BASE_PATH=/tmp`; at one rank `VLLM_ENABLE_V1_MULTIPROCESSING=0` (unless the manifest
  sets it), so the worker runs in the engine core's process as under vLLM's one-rank executor on
  a GPU (vllm-cpu otherwise spawns a worker process: a serve starts in about half the time).
- **Stop**: SIGTERM to each process group, SIGKILL after a deadline, then the pause process (the
  namespace and its mounts go with it), then the mount points the harness created.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pod_images as images
import pod_translate as translate

MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")
KVOFFLOAD_IMAGE_USER = 65532
VLLM_IMAGE_USER = 1000
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(q: str | int) -> int:
    s = str(q)
    for suffix, mult in UNITS.items():
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(float(s))


def pod_spec(doc: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, spec) of the pod a manifest makes (a Pod, or a workload's pod template)."""
    if doc["kind"] == "Pod":
        return doc["metadata"], doc["spec"]
    if doc["kind"] == "LeaderWorkerSet":
        tpl = doc["spec"]["leaderWorkerTemplate"]
        tpl = tpl.get("leaderTemplate") or tpl["workerTemplate"]
        return tpl.get("metadata") or {}, tpl["spec"]
    tpl = doc["spec"]["template"]
    return tpl.get("metadata") or {}, tpl["spec"]


def can_run_pods() -> str | None:
    """None when this box can run pods, else why not (for a clean skip)."""
    if os.geteuid() != 0:
        return "the pod harness needs root (mounts, namespaces, setpriv)"
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--propagation", "private", "--", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if probe.returncode:
        return f"unshare/mount not permitted here: {probe.stderr.strip()}"
    return None


@dataclass
class Proc:
    """One running container process and its log."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    restarts: int = 0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass(frozen=True)
class CsiDriver:
    """A CSI node plugin the kubelet part calls for the pod's inline volumes of `name`."""

    name: str
    socket: Path  # the plugin's CSI endpoint (node-driver-registrar's --csi-address)
    pods_dir: Path  # the kubelet's pods directory, where the targets are


@dataclass
class Pod:
    """A pod sandbox: see the module doc. Use `with Pod(doc, workdir) as pod: pod.start()`."""

    doc: dict[str, Any]
    workdir: Path
    uid_override: tuple[int, int] | None = None
    start_sidecars: bool = True
    csi: Sequence[CsiDriver] = ()
    name: str = translate.FIELDS["metadata.name"]
    namespace: str = translate.FIELDS["metadata.namespace"]
    pod_uid: str = field(default_factory=lambda: str(uuid.uuid4()))  # metadata.uid
    procs: dict[str, Proc] = field(default_factory=dict)
    _pause: subprocess.Popen[bytes] | None = None
    _created: list[Path] = field(default_factory=list)
    _keep_restarting: set[str] = field(default_factory=set)
    _watch: threading.Thread | None = None
    _stopping: bool = False
    _cgroups: dict[str, Path] = field(default_factory=dict)  # container -> its memory cgroup
    _published: list[tuple[CsiDriver, str, str]] = field(default_factory=list)  # volume id, target
    last_stats_error: str = ""  # why the last pool_stats() got no answer

    def __post_init__(self) -> None:
        self.meta, self.spec = pod_spec(self.doc)
        self.images = images.build()

    # -- sandbox ---------------------------------------------------------------------------
    def __enter__(self) -> Pod:
        self._pause = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "sleep", "infinity"],
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        own = os.readlink("/proc/self/ns/mnt")
        while os.readlink(f"/proc/{self._pause.pid}/ns/mnt") == own:
            if time.monotonic() > deadline:
                raise RuntimeError("pause process never entered its namespace")
            time.sleep(0.01)
        try:
            self.ns(["ip", "link", "set", "lo", "up"])
            self.ns(["ip", "addr", "add", f"{translate.POD_IP}/32", "dev", "lo"])
            self._reach_checkout()
            self._private_tmp()
            self._mount_volumes()
            self._publish_csi()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def nsenter(self) -> list[str]:
        assert self._pause is not None
        return ["nsenter", "-t", str(self._pause.pid), "-m", "-n", "--"]

    def ns(self, argv: Sequence[str], check: bool = True, timeout: float = 30) -> str:
        """Run a command as root inside the pod's namespaces; its stdout."""
        r = subprocess.run(
            [*self.nsenter(), *argv], capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode:
            raise RuntimeError(f"{shlex.join(argv)} in pod: rc {r.returncode}: {r.stderr}")
        return r.stdout

    def _mkdir(self, path: str) -> None:
        missing = [p for p in (Path(path), *Path(path).parents) if not p.exists()]
        for p in reversed(missing):
            self._created.append(p)
        self.ns(["mkdir", "-p", path])

    def _reach_checkout(self) -> None:
        root = images.ROOT
        blocked = [p for p in reversed(root.parents) if not os.stat(p).st_mode & 0o001]
        if not blocked and os.stat(root).st_mode & 0o001:
            return
        top = blocked[0] if blocked else root
        stage = tempfile.mkdtemp(prefix="kvo-pod-stage-")
        self._created.append(Path(stage))
        self.ns(["mount", "--bind", str(root), stage])
        self.ns(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(top)])
        self.ns(["mkdir", "-p", str(root)])
        self.ns(["mount", "--move", stage, str(root)])
        self.ns(["chmod", "0755", str(root)])

    def _private_tmp(self) -> None:
        """The pod's own `/tmp` (a tmpfs). A checkout under /tmp (CI may clone there) would vanish
        under it, so it is staged outside /tmp first and moved back onto the same path."""
        root = images.ROOT
        if Path("/tmp") not in root.parents:
            self.ns(["mount", "-t", "tmpfs", "-o", "size=1g,mode=1777", "tmpfs", "/tmp"])
            return
        stage = tempfile.mkdtemp(
            prefix="kvo-pod-tmp-stage-", dir="/run" if os.path.isdir("/run") else "/"
        )
        self._created.append(Path(stage))
        self.ns(["mount", "--rbind", str(root), stage])
        self.ns(["mount", "-t", "tmpfs", "-o", "size=1g,mode=1777", "tmpfs", "/tmp"])
        self.ns(["mkdir", "-p", str(root)])
        self.ns(["mount", "--move", stage, str(root)])

    def _containers(self) -> list[dict[str, Any]]:
        return list(self.spec.get("initContainers") or []) + list(self.spec["containers"])

    def _mount_volumes(self) -> None:
        empty = {v["name"]: v["emptyDir"] or {} for v in self.spec.get("volumes") or []
                 if "emptyDir" in v}  # fmt: skip
        at: dict[str, str] = {}
        for c in self._containers():
            for m in c.get("volumeMounts") or []:
                if m["name"] in empty:
                    prev = at.setdefault(m["name"], m["mountPath"])
                    if prev != m["mountPath"]:
                        raise ValueError(
                            f"volume {m['name']} mounted at {prev} and {m['mountPath']}: "
                            "this harness shares one mount namespace per pod"
                        )
        for name, path in at.items():
            size = quantity(empty[name].get("sizeLimit", "1Gi"))
            self._mkdir(path)
            self.ns(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", path])
        if any(self._image_kind(c) == "payload" for c in self._containers()):
            self._mkdir("/payload")
            self.ns(["mount", "--bind", "-o", "ro", str(self.images.payload), "/payload"])

    def csi_target(self, driver: CsiDriver, volume: str) -> Path:
        """Where the kubelet has `driver` publish this pod's inline volume `volume`."""
        return driver.pods_dir / self.pod_uid / "volumes" / "kubernetes.io~csi" / volume / "mount"

    def _publish_csi(self) -> None:
        """NodePublishVolume for each inline volume of a given driver, then its target
        bind-mounted where the containers mount the volume (see the module doc)."""
        drivers = {d.name: d for d in self.csi}
        volumes = [v for v in self.spec.get("volumes") or []
                   if (v.get("csi") or {}).get("driver") in drivers]  # fmt: skip
        if not volumes:
            return
        import grpc
        from kvoffload.csi.v1 import csi_pb2, csi_pb2_grpc

        sc = self.spec.get("securityContext") or {}
        for v in volumes:
            driver, src = drivers[v["csi"]["driver"]], v["csi"]
            target = self.csi_target(driver, v["name"])
            missing = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
            target.parent.mkdir(parents=True)  # the kubelet makes the parent, the plugin the target
            self._created.extend(reversed(missing))
            handle = "csi-" + hashlib.sha256(f"{self.pod_uid}{v['name']}".encode()).hexdigest()
            context = {
                **(src.get("volumeAttributes") or {}),
                "csi.storage.k8s.io/pod.name": self.name,
                "csi.storage.k8s.io/pod.namespace": self.namespace,
                "csi.storage.k8s.io/pod.uid": self.pod_uid,
                "csi.storage.k8s.io/serviceAccount.name": self.spec.get(
                    "serviceAccountName", translate.FIELDS["spec.serviceAccountName"]
                ),
                "csi.storage.k8s.io/ephemeral": "true",
            }
            access = csi_pb2.VolumeCapability.AccessMode
            cap = csi_pb2.VolumeCapability(access_mode=access(mode=access.SINGLE_NODE_WRITER))
            cap.mount.SetInParent()
            with grpc.insecure_channel(f"unix://{driver.socket}") as channel:
                node = csi_pb2_grpc.NodeStub(channel)
                rpc = csi_pb2.NodeServiceCapability.RPC
                caps = node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
                if "fsGroup" in sc and any(c.rpc.type == rpc.VOLUME_MOUNT_GROUP
                                           for c in caps.capabilities):  # fmt: skip
                    cap.mount.volume_mount_group = str(sc["fsGroup"])
                node.NodePublishVolume(
                    csi_pb2.NodePublishVolumeRequest(
                        volume_id=handle,
                        target_path=str(target),
                        volume_capability=cap,
                        readonly=bool(src.get("readOnly", False)),
                        volume_context=context,
                    ),
                    timeout=30,
                )
            self._published.append((driver, handle, str(target)))
            for c in self._containers():
                for m in c.get("volumeMounts") or []:
                    if m["name"] == v["name"]:
                        self._mkdir(m["mountPath"])
                        self.ns(["mount", "--bind", str(target), m["mountPath"]])

    def _unpublish_csi(self) -> None:
        if not self._published:
            return
        import grpc
        from kvoffload.csi.v1 import csi_pb2, csi_pb2_grpc

        for driver, handle, target in reversed(self._published):
            # a plugin already gone: the rest of the pod is cleaned all the same
            with (
                grpc.insecure_channel(f"unix://{driver.socket}") as channel,
                contextlib.suppress(grpc.RpcError),
            ):
                csi_pb2_grpc.NodeStub(channel).NodeUnpublishVolume(
                    csi_pb2.NodeUnpublishVolumeRequest(volume_id=handle, target_path=target),
                    timeout=30,
                )
        self._published.clear()

    # -- containers ------------------------------------------------------------------------
    @staticmethod
    def _image_kind(c: Mapping[str, Any]) -> str:
        image = c.get("image", "")
        if "kvoffload-connector" in image:
            return "payload"
        if "kvoffload" in image:
            return "kvoffload"
        return "vllm"

    def _ids(self, c: Mapping[str, Any]) -> tuple[int, int]:
        kind = self._image_kind(c)
        if kind == "vllm" and self.uid_override:
            return self.uid_override
        sc = {**(self.spec.get("securityContext") or {}), **(c.get("securityContext") or {})}
        default = VLLM_IMAGE_USER if kind == "vllm" else KVOFFLOAD_IMAGE_USER
        uid = int(sc.get("runAsUser", default))
        return uid, int(sc.get("runAsGroup", uid))

    def _env(self, c: Mapping[str, Any]) -> dict[str, str]:
        kind = self._image_kind(c)
        bin_dir = self.images.vllm_bin if kind == "vllm" else self.images.sidecar_bin
        env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}
        env.update(translate.container_env(c))
        if kind == "vllm":
            env.update(
                VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_CPU_OMP_THREADS_BIND="nobind",
                OMP_NUM_THREADS="1",
                VLLM_SERVER_DEV_MODE="1",
                VLLM_RPC_BASE_PATH="/tmp",
            )
            if translate.tensor_parallel(self.argv_of(c)) == 1:
                # one rank: the worker runs in the engine core's process, as vLLM's default
                # one-rank executor does on a GPU (vllm-cpu picks it only with this setting)
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return env

    def argv_of(self, c: Mapping[str, Any]) -> list[str]:
        if self._image_kind(c) == "vllm":
            return translate.translate(c)
        return translate.kubelet_argv(c)

    def _groups(self) -> str:
        """setpriv's supplementary groups: the pod's fsGroup and supplementalGroups, which the
        kubelet gives every container's processes."""
        sc = self.spec.get("securityContext") or {}
        groups = [sc["fsGroup"]] if "fsGroup" in sc else []
        groups += [g for g in sc.get("supplementalGroups") or [] if g not in groups]
        return f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"

    def _wrap(self, c: Mapping[str, Any], argv: Sequence[str], limit: bool = False) -> list[str]:
        uid, gid = self._ids(c)
        env = [f"{k}={v}" for k, v in self._env(c).items()]
        cg = self._memory_cgroup(c) if limit else None
        join = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"] if cg else []
        return [
            *self.nsenter(), *join,
            "setpriv", f"--reuid={uid}", f"--regid={gid}", self._groups(), "--",
            "env", "-i", *env, *argv,
        ]  # fmt: skip

    def _memory_cgroup(self, c: Mapping[str, Any]) -> Path | None:
        """The container's memory cgroup (made on first use), or None: not ours, no limit,
        or no cgroup v1 memory hierarchy root may write here."""
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if limit is None or self._image_kind(c) == "vllm":
            return None
        if c["name"] in self._cgroups:
            return self._cgroups[c["name"]]
        assert self._pause is not None
        d = MEMORY_CGROUPS / f"kvo-pod-{self._pause.pid}-{c['name']}"
        try:
            d.mkdir(exist_ok=True)
            (d / "memory.limit_in_bytes").write_text(str(quantity(limit)))
        except OSError:
            return None
        self._cgroups[c["name"]] = d
        return d

    def memory_cgroup_of(self, name: str) -> Path | None:
        """Where container `name`'s memory is charged (None: not enforced)."""
        return self._cgroups.get(name)

    def spawn(self, c: Mapping[str, Any]) -> Proc:
        name = c["name"]
        old = self.procs.get(name)
        log = self.workdir / f"{name}.log"
        out: BinaryIO = open(log, "ab")  # noqa: SIM115 (the child owns it)
        out.write(f"--- start {time.strftime('%T')} {shlex.join(self.argv_of(c))}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            self._wrap(c, self.argv_of(c), limit=True),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
        out.close()
        proc = Proc(name, popen, log, restarts=(old.restarts + 1) if old else 0)
        self.procs[name] = proc
        return proc

    def probe_once(self, c: Mapping[str, Any], probe: Mapping[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "exec" in probe:
            try:
                r = subprocess.run(
                    self._wrap(c, probe["exec"]["command"]),
                    capture_output=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                return False
            return r.returncode == 0
        if "grpc" in probe:
            port = probe["grpc"]["port"]
            code = (
                "import grpc,sys;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;"
                f"ch=grpc.insecure_channel('{probe['grpc'].get('host', translate.POD_IP)}:{port}');"
                f"r=g.HealthStub(ch).Check(h.HealthCheckRequest(),timeout={timeout});"
                "sys.exit(0 if r.status==h.HealthCheckResponse.SERVING else 1)"
            )
            r = subprocess.run(
                [*self.nsenter(), str(images.VENV / "bin" / "python"), "-c", code],
                capture_output=True,
                timeout=timeout + 10,
            )
            return r.returncode == 0
        raise ValueError(f"probe kind not emulated: {sorted(probe)}")

    def start_sidecar(self, c: Mapping[str, Any]) -> Proc:
        """Start a native sidecar and gate on its startupProbe like the kubelet (a probe that
        fails `failureThreshold` times restarts the container and gates again)."""
        proc = self.spawn(c)
        probe = c.get("startupProbe")
        if not probe:
            return proc
        period = float(probe.get("periodSeconds", 10))
        time.sleep(float(probe.get("initialDelaySeconds", 0)))
        for _ in range(int(probe.get("failureThreshold", 3))):
            if self.probe_once(c, probe):
                return proc
            time.sleep(period)
        raise RuntimeError(f"startupProbe of {c['name']} never passed:\n{proc.text()[-3000:]}")

    def run_init(self, c: Mapping[str, Any], timeout: float = 120) -> None:
        proc = self.spawn(c)
        rc = proc.popen.wait(timeout=timeout)
        if rc:
            raise RuntimeError(f"init container {c['name']} exited {rc}:\n{proc.text()}")

    def start(self) -> Proc:
        """Init containers in order (native sidecars gated on their startupProbe), then the
        main containers; returns the (first) vLLM container's process."""
        for c in self.spec.get("initContainers") or []:
            if c.get("restartPolicy") == "Always":
                if self.start_sidecars:
                    self.start_sidecar(c)
            else:
                self.run_init(c)
        main = [self.spawn(c) for c in self.spec["containers"]]
        return next(p for p, c in zip(main, self.spec["containers"], strict=True)
                    if self._image_kind(c) == "vllm")  # fmt: skip

    def sidecar(self) -> dict[str, Any]:
        inits = self.spec.get("initContainers") or []
        return next(
            c for c in inits if c.get("restartPolicy") == "Always" and "kvoffload" in c["image"]
        )

    def vllm_container(self) -> dict[str, Any]:
        return next(c for c in self.spec["containers"] if self._image_kind(c) == "vllm")

    def restart_always(self, name: str, backoff: float = 1.0) -> None:
        """Emulate restartPolicy Always for container `name`: restart it whenever it exits."""
        self._keep_restarting.add(name)
        if self._watch is None:
            self._watch = threading.Thread(target=self._watcher, args=(backoff,), daemon=True)
            self._watch.start()

    def _watcher(self, backoff: float) -> None:
        by_name = {c["name"]: c for c in self._containers()}
        while not self._stopping:
            for name in list(self._keep_restarting):
                p = self.procs.get(name)
                if p is not None and not p.alive() and not self._stopping:
                    time.sleep(backoff)
                    if not self._stopping:
                        self.spawn(by_name[name])
            time.sleep(0.1)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, sig)
        if sig == signal.SIGKILL:
            p.popen.wait(timeout=10)

    def restart(self, name: str, sig: int = signal.SIGTERM, term_s: float = 30) -> Proc:
        """Restart container `name` as the kubelet restarts one (a failed liveness probe, a
        new pod revision's process): `sig` to its process group, SIGKILL after `term_s`, then
        the same argv, uid and env again (`restarts` + 1). Not for a container that
        `restart_always` watches (its watcher restarts it after any exit)."""
        assert name not in self._keep_restarting, f"{name} is restarted by its watcher"
        c = next(c for c in self._containers() if c["name"] == name)
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, sig)
        try:
            p.popen.wait(timeout=term_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, signal.SIGKILL)  # stragglers of the group
        return self.spawn(c)

    def stop(self, term_s: float = 20) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.join(timeout=5)
        for p in self.procs.values():
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        end = time.monotonic() + term_s
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.1, end - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)  # stragglers of the group too
            p.popen.wait(timeout=10)
        if self._pause is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._pause.pid, signal.SIGKILL)
            self._pause.wait(timeout=10)
            self._pause = None
        self._unpublish_csi()  # the kubelet unpublishes once the pod's containers are gone
        for p in reversed(self._created):
            with contextlib.suppress(OSError):
                p.rmdir()
        self._created.clear()
        for cg in self._cgroups.values():  # empty once its processes and the pod's tmpfs went
            with contextlib.suppress(OSError):
                (cg / "memory.force_empty").write_text("0")
            with contextlib.suppress(OSError):
                cg.rmdir()
        self._cgroups.clear()

    # -- serving ---------------------------------------------------------------------------
    def curl(
        self, method: str, path: str, body: Any = None, timeout: float = 60
    ) -> tuple[int, str]:
        """An HTTP request to the vLLM container over the pod's loopback."""
        argv = ["curl", "-s", "-m", str(timeout), "-X", method, "-w", "\n%{http_code}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        r = subprocess.run(
            [*self.nsenter(), *argv, f"http://127.0.0.1:{translate.PORT}{path}"],
            capture_output=True,
            text=True,
            timeout=timeout + 10,
        )
        text, _, code = r.stdout.rpartition("\n")
        return int(code or 0), text

    def wait_serving(self, engine: Proc, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not engine.alive():
                raise RuntimeError(
                    f"vLLM exited {engine.popen.returncode}:\n{engine.text()[-6000:]}"
                )
            if self.curl("GET", "/health", timeout=2)[0] == 200:
                return
            time.sleep(1)
        raise TimeoutError(f"vLLM not serving after {timeout} s:\n{engine.text()[-6000:]}")

    def model_name(self) -> str:
        code, text = self.curl("GET", "/v1/models")
        assert code == 200, text
        return str(json.loads(text)["data"][0]["id"])

    def complete(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of token-id prompts; the generated token ids."""
        model = self.model_name()
        out = []
        for p in prompts:
            body = {
                "model": model,
                "prompt": list(p),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            code, text = self.curl("POST", "/v1/completions", body)
            assert code == 200, f"completion failed: {code} {text}"
            out.append(list(json.loads(text)["choices"][0]["token_ids"]))
        return out

    def reset_prefix_cache(self) -> None:
        code, text = self.curl("POST", "/reset_prefix_cache")
        assert code == 200, f"reset_prefix_cache: {code} {text}"

    def pool_stats(self, socket: str) -> dict[str, Any] | None:
        """`kvoffload stats --json` inside the pod (None when the sidecar does not answer)."""
        r = subprocess.run(
            [*self.nsenter(), str(images.VENV / "bin" / "kvoffload"), "stats", "--json",
             "--socket", socket, "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=30,
        )  # fmt: skip
        failed = f"rc={r.returncode}: {r.stderr[-2000:]}"
        self.last_stats_error = "" if r.returncode == 0 else failed
        return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def pool_hits(stats: Mapping[str, Any] | None) -> int:
    return sum(int(ns.get("hit_blocks", 0)) for ns in (stats or {}).get("namespaces", []))


def socket_of(sidecar: Mapping[str, Any]) -> str:
    for a in [*(sidecar.get("command") or []), *(sidecar.get("args") or [])]:
        if a.startswith("--socket="):
            return a.split("=", 1)[1]
    words = [*(sidecar.get("command") or []), *(sidecar.get("args") or [])]
    return words[words.index("--socket") + 1]


def pool_dir_of(sidecar: Mapping[str, Any]) -> str:
    for a in sidecar.get("args") or []:
        if a.startswith("--pool-dir="):
            return a.split("=", 1)[1]
    words = list(sidecar.get("args") or [])
    return words[words.index("--pool-dir") + 1]


def harness_uid(text: str) -> tuple[int, int] | None:
    """`# harness-uid: U:G` in a manifest's header (OpenShift's arbitrary uid), else None."""
    for line in text.splitlines():
        if line.startswith("# harness-uid:"):
            u, g = line.split(":", 1)[1].strip().split(":")
            return int(u), int(g)
    return None


@contextlib.contextmanager
def running(doc: dict[str, Any], workdir: Path, **kw: Any) -> Iterator[tuple[Pod, Proc]]:
    """A started, serving pod; stopped (and cleaned) on exit."""
    with Pod(doc, workdir, **kw) as pod:
        engine = pod.start()
        pod.wait_serving(engine)
        yield pod, engine


class NodeAgent:
    """`kvoffload node-agent` as its DaemonSet runs it on a node (here with a fixed node pool
    file instead of the API): the CSI node plugin of `node.kvoffload.io`, whose socket and pods
    directory the pods' kubelet part is given (`driver`). Its directory is under /run, not
    /tmp: every pod has its own /tmp, and the agent's sockets must be where the pods' bind
    mounts find them; its log is `workdir/node-agent.log`. Use `with NodeAgent(pool, workdir) as
    agent: Pod(..., csi=[agent.driver])`."""

    DRIVER = "node.kvoffload.io"

    def __init__(self, pool: Mapping[str, Any], workdir: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvo-node-", dir="/run"))
        self.pool = pool
        self.log = workdir / "node-agent.log"
        self.driver = CsiDriver(self.DRIVER, self.root / "csi.sock", self.root / "kubelet" / "pods")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> NodeAgent:
        pool_file = self.root / "node-pool.json"
        pool_file.write_text(json.dumps(self.pool))
        self.driver.pods_dir.mkdir(parents=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(images.VENV / "bin" / "kvoffload"), "node-agent",
                 "--csi-socket", str(self.driver.socket), "--node-id", "node",
                 "--node-pool", str(pool_file), "--state-dir", str(self.root / "state"),
                 "--publish-root", str(self.driver.pods_dir)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while "node agent serving" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the node agent did not start:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
