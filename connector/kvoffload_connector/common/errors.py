"""The one error the connector's sidecar clients raise (gRPC and framed sessions alike)."""


class PoolUnavailable(Exception):
    """The sidecar did not answer (down, slow, or refused): a miss for the caller."""
