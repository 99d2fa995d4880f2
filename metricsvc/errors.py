"""The errors and warnings metricsvc raises, by meaning: the public name of
``metricsvc.core.errors`` (``from metricsvc.errors import Refused`` on a rank or a driver)."""

from metricsvc.core.errors import *  # noqa: F403
from metricsvc.core.errors import __all__  # noqa: F401
