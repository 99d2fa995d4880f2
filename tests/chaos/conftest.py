"""Chaos tests share the session's Ray cluster and the worker factory."""

from tests.conftest import make_worker, ray_cluster  # noqa: F401
