"""Storage: what a run keeps on disk, and the run's history that decides what it means.

The run's history (its segments, each sink's durable record and watermark), the journal
read back (where it is, its steps, an index), the run folder (one run per folder, one live
service per run), and files written whole: atomic replaces, line files, dead letters. It
imports ``metricsvc.core`` only: never the sinks, the service, pydantic or Ray.
"""
