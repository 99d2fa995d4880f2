"""The service: the MetricWorker actor and the parts of a step's life.

Aggregation (``aggregator``: batches in, finished steps out), the run's world size and
lagging ranks (``ranks``), admission, step output and derivation, results for readers,
streams, rewinds, the straggler timer, the per-node combiner, and starting and stopping
it all from a driver (``start``). It may import ``metricsvc.core``, ``metricsvc.storage``,
``metricsvc.sinks``, ``metricsvc.config`` and ``metricsvc.protocol``; never torch nor
``metricsvc.client``. The merge (``aggregator`` and what it holds) loads neither Ray nor
pydantic.
"""
