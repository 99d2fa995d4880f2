"""The core: what a step's numbers are, on every side of the service.

Records and their merge, the quantile sketch, reduce kinds, key rules, errors, the wire
codec, formulas and declarations, the limits and defaults every side reads. Pure Python
and numpy: it imports nothing of metricsvc outside ``metricsvc.core``, and neither Ray,
pydantic, torch nor any file or network I/O. Ranks, the service and the command line all
build on it.
"""
