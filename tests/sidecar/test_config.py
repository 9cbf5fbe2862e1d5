"""Sidecar settings: sizes, flags vs environment, one clear error per bad setting."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from kvoffload_sidecar.cli import main_sidecar
from kvoffload_sidecar.config import ConfigError, SidecarConfig, check_environment, parse_config
from kvoffload_sidecar.units import format_bytes, parse_size

TMPFS_MOUNTS = "tmpfs {dir} tmpfs rw 0 0\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1 << 30),
        ("64Gi", 64 << 30),
        ("512Mi", 512 << 20),
        ("1G", 10**9),
        ("1.5GiB", 3 << 29),
        ("4ki", 4096),
        ("2M", 2 * 10**6),
        (" 8Mi ", 8 << 20),
    ],
)
def test_parse_size_accepts_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0", "greater than zero"),
        ("0Gi", "greater than zero"),
        ("-1Gi", "greater than zero"),
        ("garbage", "not a size"),
        ("12XB", "not a size"),
        ("1.5", "whole number of bytes"),
        ("", "not a size"),
        ("1e9", "not a size"),
    ],
)
def test_parse_size_rejects_bad_sizes(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_size(text)


def test_format_bytes_is_readable() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(64 << 30) == "64.0 GiB"


def _base(tmp_path: Path) -> list[str]:
    return [
        "--pool-size",
        "64Mi",
        "--pool-dir",
        str(tmp_path),
        "--socket",
        str(tmp_path / "s.sock"),
    ]


def test_flags_parse_into_a_frozen_config(tmp_path: Path) -> None:
    argv = _base(tmp_path) + [
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "[::]:9400",
        "--eviction",
        "ARC",
        "--numa-node",
        "0",
        "--max-namespaces",
        "3",
        "--client-timeout",
        "2.5",
        "--detach-grace",
        "0",
        "--log-level",
        "debug",
        "--pool-retry-interval",
        "0.5",
    ]
    config = parse_config(argv, environ={})
    assert config == SidecarConfig(
        pool_size=64 << 20,
        pool_dir=tmp_path,
        socket=tmp_path / "s.sock",
        listen="127.0.0.1:0",
        metrics_listen="[::]:9400",
        eviction="arc",
        numa_node=0,
        max_namespaces=3,
        client_timeout_s=2.5,
        detach_grace_s=0.0,
        log_level="DEBUG",
        pool_retry_interval_s=0.5,
    )
    with pytest.raises(AttributeError):
        config.pool_size = 1  # type: ignore[misc]


def test_environment_fills_in_and_flags_win(tmp_path: Path) -> None:
    env = {
        "KVOFFLOAD_POOL_SIZE": "1Gi",
        "KVOFFLOAD_POOL_DIR": str(tmp_path),
        "KVOFFLOAD_SOCKET": str(tmp_path / "env.sock"),
        "KVOFFLOAD_EVICTION": "arc",
        "KVOFFLOAD_HUGEPAGES": "true",
        "KVOFFLOAD_MAX_NAMESPACES": "",  # empty counts as unset
    }
    config = parse_config(["--pool-size", "2Gi"], environ=env)
    assert config.pool_size == 2 << 30  # flag wins
    assert config.socket == tmp_path / "env.sock"
    assert config.eviction == "arc"
    assert config.hugepages is True
    assert config.max_namespaces == 1


@pytest.mark.parametrize(
    ("extra", "env", "expected"),
    [
        (
            ["--pool-size", "0"],
            {},
            "--pool-size (env KVOFFLOAD_POOL_SIZE, here from --pool-size): '0' must be",
        ),
        (["--pool-size", "lots"], {}, "'lots' is not a size"),
        (
            [],
            {"KVOFFLOAD_EVICTION": "fifo"},
            "--eviction (env KVOFFLOAD_EVICTION, here from KVOFFLOAD_EVICTION)",
        ),
        (["--numa-node", "-1"], {}, "--numa-node"),
        (["--max-namespaces", "0"], {}, "--max-namespaces"),
        (["--client-timeout", "nan"], {}, "--client-timeout"),
        (["--detach-grace", "-1"], {}, "--detach-grace"),
        (["--pool-retry-interval", "0"], {}, "--pool-retry-interval"),
        ([], {"KVOFFLOAD_DETACH_GRACE": "soon"}, "'soon' is not a number of seconds"),
        (["--listen", "9090"], {}, "not HOST:PORT"),
        (["--metrics-listen", "host:99999"], {}, "out of range"),
        (["--log-level", "chatty"], {}, "--log-level"),
        ([], {"KVOFFLOAD_HUGEPAGES": "maybe"}, "--hugepages"),
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
    ],
)
def test_bad_values_name_the_setting(
    tmp_path: Path, extra: list[str], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_base(tmp_path) + extra, environ=env)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_required_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--pool-dir \(env KVOFFLOAD_POOL_DIR\) is required"):
        parse_config(["--pool-size", "1Gi", "--socket", str(tmp_path / "s")], environ={})


def _config(tmp_path: Path, **overrides: object) -> SidecarConfig:
    fields = {"pool_size": 1 << 20, "pool_dir": tmp_path, "socket": tmp_path / "s.sock"}
    fields.update(overrides)
    return SidecarConfig(**fields)  # type: ignore[arg-type]


def test_environment_check_accepts_tmpfs_without_warnings(tmp_path: Path) -> None:
    assert check_environment(_config(tmp_path), mounts_text=TMPFS_MOUNTS.format(dir=tmp_path)) == []


def test_environment_check_warns_off_tmpfs(tmp_path: Path) -> None:
    warnings = check_environment(
        _config(tmp_path), mounts_text=f"/dev/sda1 {tmp_path} ext4 rw 0 0\n"
    )
    assert len(warnings) == 1
    assert "not tmpfs/hugetlbfs" in warnings[0]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: _config(p, pool_dir=p / "missing"), "--pool-dir .* does not exist"),
        (lambda p: _config(p, pool_dir=p / "file"), "--pool-dir .* is not a directory"),
        (lambda p: _config(p, socket=p / "nodir" / "s.sock"), "--socket .* parent directory"),
        (lambda p: _config(p, socket=p / "file"), "--socket .* exists and is not a socket"),
        (lambda p: _config(p, socket=p / ("x" * 120)), "--socket .* longer than 107 bytes"),
        (lambda p: _config(p, numa_node=4096), "--numa-node .* node 4096 does not exist"),
        (lambda p: _config(p, hugepages=True), "--hugepages .* not hugetlbfs"),
        (lambda p: _config(p, pool_size=1 << 60), "--pool-size .* does not fit"),
    ],
)
def test_environment_check_rejects(tmp_path: Path, make, expected: str) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=expected):
        check_environment(make(tmp_path), mounts_text=TMPFS_MOUNTS.format(dir=tmp_path))


def test_environment_check_rejects_a_bad_native_index_switch(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVOFFLOAD_NATIVE_INDEX", "maybe")
    with pytest.raises(ConfigError, match="KVOFFLOAD_NATIVE_INDEX must be 1 or 0.*'maybe'"):
        check_environment(_config(tmp_path), mounts_text=TMPFS_MOUNTS.format(dir=tmp_path))
    monkeypatch.setenv("KVOFFLOAD_NATIVE_INDEX", "Off")
    assert check_environment(_config(tmp_path), mounts_text=TMPFS_MOUNTS.format(dir=tmp_path)) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_environment_check_rejects_read_only_dir(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="--pool-dir .* is not writable"):
        check_environment(_config(tmp_path, pool_dir=ro), mounts_text="")


def test_live_socket_is_refused_and_stale_one_accepted(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    try:
        with pytest.raises(ConfigError, match="another process is serving"):
            check_environment(_config(tmp_path), mounts_text=TMPFS_MOUNTS.format(dir=tmp_path))
    finally:
        listener.close()
    assert path.exists()  # closed but not unlinked: a stale socket file
    assert check_environment(_config(tmp_path), mounts_text=TMPFS_MOUNTS.format(dir=tmp_path)) == []


def test_the_framed_socket_path_must_fit_too_or_be_turned_off(tmp_path: Path) -> None:
    """`<socket>.session` is 8 bytes longer than the socket: a path that fits only without
    the suffix is refused with the way out named."""
    fits_alone = tmp_path / ("x" * (107 - len(os.fsencode(tmp_path)) - 3))
    mounts = TMPFS_MOUNTS.format(dir=tmp_path)
    with pytest.raises(ConfigError, match="--socket .*session.* --framed-sessions false"):
        check_environment(_config(tmp_path, socket=fits_alone), mounts_text=mounts)
    assert (
        check_environment(
            _config(tmp_path, socket=fits_alone, framed_sessions=False), mounts_text=mounts
        )
        == []
    )
    parsed = parse_config(
        [
            "--pool-size",
            "1Gi",
            "--pool-dir",
            str(tmp_path),
            "--socket",
            "s",
            "--framed-sessions",
            "no",
        ],
        environ={},
    )
    assert parsed.framed_sessions is False
    assert parse_config(
        ["--pool-size", "1", "--pool-dir", "d", "--socket", "s"], {}
    ).framed_sessions


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--pool-size", "-5"], "--pool-size"),
        (["--pool-size", "1Gi", "--pool-dir", "/nonexistent-kvoffload"], "--pool-dir"),
        (["--eviction", "mru"], "--eviction"),
    ],
)
def test_main_sidecar_exits_2_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expected: str,
) -> None:
    monkeypatch.setenv("KVOFFLOAD_POOL_SIZE", "1Mi")
    monkeypatch.setenv("KVOFFLOAD_POOL_DIR", str(tmp_path))
    monkeypatch.setenv("KVOFFLOAD_SOCKET", str(tmp_path / "s.sock"))
    assert main_sidecar(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("kvoffload sidecar: error: ")
    assert expected in err


@pytest.mark.parametrize(
    ("timeout", "grace", "period"),
    [(60.0, 2.0, 1.0), (60.0, 0.0, 10.0), (2.0, 30.0, 0.5), (60.0, 0.05, 0.1)],
)
def test_reaping_keeps_up_with_the_detach_grace(
    tmp_path: Path, timeout: float, grace: float, period: float
) -> None:
    config = SidecarConfig(
        pool_size=1 << 20,
        pool_dir=tmp_path,
        socket=tmp_path / "s.sock",
        client_timeout_s=timeout,
        detach_grace_s=grace,
    )
    assert config.reap_interval_s == period
