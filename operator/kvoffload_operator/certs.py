"""Webhook serving certificates made with `cryptography` (kopf's own helper needs oscrypto,
which fails on OpenSSL 3 here). Used by ``--self-signed-certs`` and by the HTTPS tests.

The CA's key is kept beside the pair (``ca.key``): a renewed serving certificate is signed by the
same CA, so the webhook configurations' caBundle never changes and replicas serving the old and
the new certificate during a renewal are both trusted."""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS, CERT_DAYS = 3650, 825


@dataclass(frozen=True)
class CertBundle:
    ca_pem: bytes
    cert_pem: bytes  # serving certificate, signed by the CA
    key_pem: bytes  # its private key (PKCS8, unencrypted)
    ca_key_pem: bytes = b""  # the CA's key, to sign a renewed serving certificate (b"": unknown)

    def write(self, directory: Path) -> tuple[Path, Path]:
        """Write ``tls.crt``/``tls.key``/``ca.crt`` (each replaced atomically: kopf's server,
        which reloads when they change, never reads half a pair); returns (cert, key) paths."""
        directory.mkdir(parents=True, exist_ok=True)
        _replace(directory / "ca.crt", self.ca_pem, 0o644)
        _replace(directory / "tls.key", self.key_pem, 0o600)
        _replace(directory / "tls.crt", self.cert_pem, 0o644)
        return directory / "tls.crt", directory / "tls.key"

    def secret_data(self) -> dict[str, bytes]:
        data = {"tls.crt": self.cert_pem, "tls.key": self.key_pem, "ca.crt": self.ca_pem}
        if self.ca_key_pem:
            data["ca.key"] = self.ca_key_pem
        return data

    @classmethod
    def from_secret(cls, data: dict[str, bytes]) -> CertBundle | None:
        """The bundle stored in a Secret's data; None when the pair is incomplete."""
        if not (data.get("tls.crt") and data.get("tls.key") and data.get("ca.crt")):
            return None
        return cls(data["ca.crt"], data["tls.crt"], data["tls.key"], data.get("ca.key", b""))


def _replace(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def service_dns_names(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def generate(
    dns_names: list[str], ip_addresses: tuple[str, ...] = (), now: datetime.datetime | None = None
) -> CertBundle:
    """A fresh CA and a serving certificate for ``dns_names`` (and IPs), ECDSA P-256."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _ca(ca_key, now)
    return _issue(ca, ca_key, dns_names, ip_addresses, now)


def _ca(ca_key: ec.EllipticCurvePrivateKey, now: datetime.datetime) -> x509.Certificate:
    ca_name = _name("kvoffload-webhook-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca


def renew(
    bundle: CertBundle,
    dns_names: list[str],
    ip_addresses: tuple[str, ...] = (),
    now: datetime.datetime | None = None,
) -> CertBundle:
    """A new serving certificate signed by ``bundle``'s CA (a fresh CA when its key is unknown
    or the CA itself expires within the new certificate's lifetime)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_pem)
        ca_key = serialization.load_pem_private_key(bundle.ca_key_pem, password=None)
    except (ValueError, TypeError):
        return generate(dns_names, ip_addresses, now)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or ca.not_valid_after_utc < now + (
        datetime.timedelta(days=CERT_DAYS)
    ):
        return generate(dns_names, ip_addresses, now)
    return _issue(ca, ca_key, dns_names, ip_addresses, now)


def _issue(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    dns_names: list[str],
    ip_addresses: tuple[str, ...],
    now: datetime.datetime,
) -> CertBundle:
    ca_name = ca.subject
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns_names[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    pkcs8, clear = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    return CertBundle(
        ca.public_bytes(pem),
        cert.public_bytes(pem),
        key.private_bytes(pem, pkcs8, clear),
        ca_key.private_bytes(pem, pkcs8, clear),
    )


def still_valid(cert_pem: bytes, dns_names: list[str], min_days: int = 30) -> bool:
    """Whether a stored serving certificate covers ``dns_names`` for ``min_days`` more days."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    return set(dns_names) <= set(sans.get_values_for_type(x509.DNSName)) and left.days >= min_days


def issued_by(cert_pem: bytes, ca_pem: bytes) -> bool:
    """Whether ``cert_pem`` is signed by the CA certificate ``ca_pem``."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
