"""The core: what a step's numbers are, on every side of the service.

Records and their merge (and where each min and max came from), the quantile sketch, reduce
kinds and the one finalizer, key rules, the wire batch (its bytes and its rules), formulas
and declarations, the limits every side reads, redaction. Pure Python and numpy: it
imports nothing of metricsvc outside ``metricsvc.core`` but the errors
(``metricsvc.errors``), and neither Ray, pydantic, torch nor any file or network I/O.
"""
