"""The operator's version (a module of its own: the offline injector needs it without kopf)."""

VERSION = "0.1.0"
