"""What the cluster admin allows a KVOffloadPolicy to ask for (pure; the operator's settings).

A policy is a pod-mutation privilege: whoever writes one picks images that run in vLLM pods
(the sidecar, and the connector payload that lands on vLLM's ``PYTHONPATH``) and the sidecar's
security context. The admin bounds that with helm values the CRD cannot see:

- ``allowed_images``: image references a policy may name for ``spec.sidecar.image`` and
  ``spec.connector.image``. The repositories of the operator's own ``--sidecar-image`` and
  ``--connector-image`` are always allowed (a policy naming no image gets them anyway);
- ``allow_privileged``: whether ``securityProfile: privileged`` is allowed (default: no);
- ``allowed_capabilities``: which ``extraCapabilities`` are allowed (default: none).

An entry of ``allowed_images`` is a repository (``ghcr.io/org/img``: any tag or digest of it),
a prefix ending in ``/`` (``registry.corp/``: anything below it), or a pinned reference with a
digest (``ghcr.io/org/img@sha256:…``: exactly that). ``*`` allows any image.

The same check runs at apply (the policy-validating webhook refuses the policy), in the index
the pod webhook reads (a policy that got in earlier is never injected) and at reconcile (its
status says ``Ready=False``, reason ``NotAllowed``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload_operator.policy import Policy, SecurityProfile

NOT_ALLOWED = "NotAllowed"


def repository(image: str) -> str:
    """``image`` without its tag or digest: ``reg:5000/a/b:1@sha256:x`` → ``reg:5000/a/b``."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


@dataclass(frozen=True)
class Guardrails:
    allowed_images: tuple[str, ...] = ()
    allow_privileged: bool = False
    allowed_capabilities: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        allowed_images: str | Iterable[str],
        allow_privileged: bool,
        allowed_capabilities: str | Iterable[str],
        defaults: Iterable[str] = (),
    ) -> Guardrails:
        """From the operator's comma-separated flags plus its default images' repositories."""
        images = _split(allowed_images) + tuple(repository(d) for d in defaults if d)
        return cls(images, allow_privileged, _split(allowed_capabilities))

    def image_allowed(self, image: str) -> bool:
        for entry in self.allowed_images:
            if entry == "*":
                return True
            if "@" in entry:
                if image == entry:
                    return True
            elif entry.endswith("/"):
                if image.startswith(entry):
                    return True
            elif repository(image) == entry:
                return True
        return False

    def problems(self, policy: Policy) -> list[str]:
        """Why ``policy`` is outside what the admin allows (empty: allowed)."""
        out = []
        for path, image in (
            ("spec.sidecar.image", policy.sidecar.image),
            ("spec.connector.image", policy.connector.image),
        ):
            if image is not None and not self.image_allowed(image):
                out.append(
                    f"{path}: {image!r} is not in the images the cluster admin allows "
                    f"({', '.join(self.allowed_images) or 'none'}; helm value "
                    "policyGuardrails.allowedImages)"
                )
        if policy.sidecar.security_profile is SecurityProfile.PRIVILEGED and not (
            self.allow_privileged
        ):
            out.append(
                "spec.sidecar.securityProfile: privileged is not allowed by the cluster admin "
                "(helm value policyGuardrails.allowPrivileged)"
            )
        refused = [
            c for c in policy.sidecar.extra_capabilities if c not in self.allowed_capabilities
        ]
        if refused:
            out.append(
                f"spec.sidecar.extraCapabilities: {', '.join(refused)} not allowed by the cluster "
                f"admin (allowed: {', '.join(self.allowed_capabilities) or 'none'}; helm value "
                "policyGuardrails.allowedCapabilities)"
            )
        return out

    def message(self, policy: Policy) -> str | None:
        problems = self.problems(policy)
        return "; ".join(problems) if problems else None


def _split(value: str | Iterable[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(i.strip() for i in items if i and i.strip())
