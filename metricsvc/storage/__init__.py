"""Storage: what a run keeps on disk, and the run's history that decides what it means.

The run's history (its segments, each sink's watermark), the journal (the service's
durability log, written and read back), the run folder (one run per folder, one live
service per run) and atomic file writes. It imports ``metricsvc.core`` and the config
base (``metricsvc.config_base``) only: never the sinks, the service or Ray.
"""
