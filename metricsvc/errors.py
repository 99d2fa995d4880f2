"""Every error and warning metricsvc raises, by meaning, in one small hierarchy.

Catch by what happened, whichever side raised it:

- ``Refused``: the input broke a rule (the message names the key and the rule); nothing
  of it was merged, and sending it again cannot help. ``BatchRejected`` (the service
  refused a batch), ``StepMismatch`` (a client refused to close a step it does not hold).
- ``Unavailable``: a service or a result cannot be reached. ``ServiceUnavailable`` (no
  MetricWorker, or none answered within the budget; ``ServiceClosed``, also a
  ``Refused``: the service is closed and refused the batch), ``StepUnavailable`` (no
  result for that step here).
- ``NotFinal``: a step is not published yet. ``StepNotFinal``.
- ``Late``: data for a step already published. ``StepAlreadyFinal`` (a client joined
  late and moved on), ``LateBatch`` (a warning: the batch was journaled, not merged).
- ``NotSetUp``: a call made before the set-up it needs (the module-level
  ``stats_tracker`` calls before ``stats_tracker.init``).

Each also derives from the builtin a caller may already catch (``ValueError``,
``LookupError``, ``TimeoutError``, ``RuntimeError``). A leaf module every tier imports:
``from metricsvc.errors import Refused`` on a rank or a driver.
"""

from __future__ import annotations


class MetricsvcError(Exception):
    """Base of every metricsvc error."""


class Refused(MetricsvcError, ValueError):
    """Input that breaks a rule; nothing of it was merged; resending it cannot help."""


class BatchRejected(Refused):
    """A batch the service refused; nothing of it was merged."""


class StepMismatch(Refused):
    """The step a caller names is not the step this client holds records for."""


class Unavailable(MetricsvcError):
    """A service or a result cannot be reached."""


class ServiceUnavailable(Unavailable, RuntimeError):
    """The MetricWorker is gone for good, or stayed unreachable for the whole budget."""


class ServiceClosed(ServiceUnavailable, Refused):
    """The MetricWorker is closed (``close()`` / ``stop_metric_worker`` began): the batch was
    refused, nothing of it merged, and no resend to this service can help."""


class StepUnavailable(Unavailable, LookupError):
    """The asked-for step has no result here (never submitted, or evicted from memory)."""


class NotFinal(MetricsvcError):
    """A step is not published yet."""


class StepNotFinal(NotFinal, TimeoutError):
    """``wait_final_res`` gave up: the step did not become final within the timeout."""


class Late(MetricsvcError):
    """Data for a step the service had already published."""


class StepAlreadyFinal(Late, ValueError):
    """A client's first flush named a step the service had already published (a late
    joiner); the client has moved to the open step."""


class LateBatch(Late, UserWarning):
    """A warning: a closed step reached the service after the step was published (partial)
    without it. Its data is journaled as late and never merged.
    ``warnings.simplefilter("error", LateBatch)`` turns it into an exception."""


class NotSetUp(MetricsvcError, RuntimeError):
    """A call made before the set-up it needs; the message names the set-up call."""


class ServiceNotice(UserWarning):
    """A warning: the service dropped an earlier batch of this rank (e.g. a world-size
    disagreement), ignored its declaration, left a value of its step out (two sources of
    one name, a name a sink tag does not show), sees it lag, or a sent batch could not be
    withdrawn."""


def is_refusal(error: BaseException) -> bool:
    """Return True if ``error`` (raised here, or by the actor and re-raised by Ray) means
    the input was refused: resending the same bytes cannot help. The one rule the
    client, streams and combiners use to decide whether to keep a batch for a resend."""
    return isinstance(error, Refused)


__all__ = [
    "MetricsvcError",
    "Refused",
    "BatchRejected",
    "StepMismatch",
    "Unavailable",
    "ServiceUnavailable",
    "ServiceClosed",
    "StepUnavailable",
    "NotFinal",
    "StepNotFinal",
    "Late",
    "StepAlreadyFinal",
    "LateBatch",
    "NotSetUp",
    "ServiceNotice",
    "is_refusal",
]
