"""The ``metricsvc`` command (``main``) and its demo: the top tier, which may import any
other (the demo runs ranks, so it alone loads ``metricsvc.client``)."""
