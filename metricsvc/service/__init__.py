"""The service: the step's life as a pure engine under a thin actor shell.

The engine (``engine``, with what it holds: ``steps``, ``output``, ``derive``,
``streams``) takes decoded batches and a clock and gives finished steps and answers: no
Ray, no threads, no I/O. The shell (``worker``: the MetricWorker actor) holds the locks,
the readers, the timer, the sinks' hand-off and the run folder; ``observe`` reports its
health to Ray's metrics; ``combiner`` gathers a node's ranks; ``start`` starts, finds and
stops it from a driver. It may import ``metricsvc.core``, ``metricsvc.storage``,
``metricsvc.sinks``, ``metricsvc.config``, ``metricsvc.transport`` and ``metricsvc.errors``;
never torch nor ``metricsvc.client``.
"""
