"""The ``metricsvc`` command: demo, report, plot, health, validate-config.

Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import math
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from metricsvc import __version__
from metricsvc.config import load_config, presets
from metricsvc.core.keys import DEFAULT_NAME, NAMESPACE_ENV, default_namespace
from metricsvc.core.redaction import Redactor
from metricsvc.sinks.console import alert_line, nonfinite_text, top_line, where_text
from metricsvc.storage.journal import journals_under, read_journal


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# -- journal helpers ---------------------------------------------------------------------
def journal_path(target: str) -> Path:
    """Return the journal of a run folder, or the journal file itself."""
    path = Path(target)
    if path.is_dir():
        found = journals_under(path)
        if not found:
            raise CliError(f"no journal under {path}")
        path = max(found, key=lambda p: p.stat().st_mtime)  # the newest run, not the last name
    elif not path.is_file():
        raise CliError(f"no such run folder or journal: {path}")
    with open(path, "rb") as fh:
        head = fh.read(8192)
    # (a multi-byte character cut at the 8 KiB boundary is not binary data)
    if b"\0" in head or head.decode("utf-8", "replace").count("\ufffd") > 3:
        raise CliError(f"{path} is not a metrics journal: it holds binary data")
    return path


def load_steps(target: str) -> list[dict[str, Any]]:
    """Return the journal's steps (one per step); say on stderr what was read and skipped."""
    path = journal_path(target)
    stats: dict[str, Any] = {}
    reader = logging.getLogger("metricsvc.storage.journal")
    level = reader.level
    reader.setLevel(logging.ERROR)  # each skipped line is counted below, not logged
    try:
        steps = read_journal(path, stats)
    finally:
        reader.setLevel(level)
    notes = [f"{stats['duplicates']} duplicate step records dropped"] * bool(stats["duplicates"])
    notes += [f"{stats['skipped']} unreadable lines skipped"] * bool(stats["skipped"])
    print(f"# {path}: {len(steps)} steps" + (f" ({'; '.join(notes)})" if notes else ""),
          file=sys.stderr)
    if not steps:
        raise CliError(f"{target}: the journal holds no finished step")
    return steps


def select_keys(steps: list[dict[str, Any]], patterns: Sequence[str] | None) -> list[str]:
    keys = sorted({k for s in steps for k in s["metrics"]})
    if patterns:
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
        if not keys:
            raise CliError(f"no key matches {' '.join(patterns)}")
    return keys


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.6g}"


# -- commands ----------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> None:
    every = load_steps(args.target)
    steps = every[-args.last:]
    keys = select_keys(steps, args.keys)
    heads = [f"{s['step']}{'*' if s['meta'].get('partial') else ''}" for s in steps]
    width = max(len(k) for k in keys)
    cols = [max(len(h), 12) for h in heads]
    print(f"{'step':<{width}}  " + "  ".join(h.rjust(c) for h, c in zip(heads, cols)))
    for key in keys:
        cells = [_fmt(s["metrics"].get(key)).rjust(c) for s, c in zip(steps, cols)]
        print(f"{key:<{width}}  " + "  ".join(cells))
    partial = [s for s in steps if s["meta"].get("partial")]
    for s in partial:
        print(f"* step {s['step']} is partial: missing ranks {s['meta'].get('missing_ranks')}")
    if args.extremes:
        print_extremes(steps, keys, width)
    if args.top:
        print_top(steps, keys)
    if args.nonfinite:
        print_nonfinite(steps, args.keys)
    if args.alerts:
        print_alerts(every)
    if len(steps) < len(every):
        print(f"# the last {len(steps)} of {len(every)} steps (--last N shows more)")
    else:
        print(f"# all {len(steps)} steps")


def print_top(steps: list[dict[str, Any]], keys: list[str]) -> None:
    """The samples ``stat(top=k)`` kept for each shown min and max (``meta.top``)."""
    print("\nthe k smallest and largest samples (stat(top=k)):")
    shown = 0
    for s in steps:
        for name, samples in s["meta"].get("top", {}).items():
            if name in keys:
                shown += 1
                print(f"step {s['step']} {name}: {top_line(samples)}")
                for sample in samples:  # stat(text=): each payload, on one line
                    if "text" in sample:
                        said = sample["text"]
                        said = said if isinstance(said, str) else json.dumps(said)
                        said = " ".join(said.splitlines())
                        print(f"    {sample['value']:.6g}: "
                              f"{said[:100] + '…' if len(said) > 100 else said}")
    if not shown:
        print("(none: no shown key was recorded with stat(top=k) in these steps)")


def print_nonfinite(steps: list[dict[str, Any]], patterns: Sequence[str] | None) -> None:
    """Where each key's first non-finite value came from (``meta.nonfinite_first``)."""
    print("\nwhere each key's first non-finite value came from (stat(ids=) names the "
          "sample):")
    shown = 0
    for s in steps:
        for key, where in s["meta"].get("nonfinite_first", {}).items():
            if not patterns or any(fnmatch.fnmatchcase(key, p) for p in patterns):
                shown += 1
                print(f"step {s['step']} {key}: {nonfinite_text(where)}")
    if not shown:
        print("(none: no non-finite value in a valid position in these steps)")


def print_alerts(steps: list[dict[str, Any]]) -> None:
    """Every alert of the run (``meta.alerts``), with the samples it names."""
    found = [alert for s in steps for alert in s["meta"].get("alerts", ())]
    print(f"\nthe run's alerts ({len(found)}; their samples with ids are in "
          f"flagged_samples.jsonl):")
    for alert in found:
        print(alert_line(alert), end="")
    if not found:
        print("(none)")


def print_extremes(steps: list[dict[str, Any]], keys: list[str], width: int) -> None:
    """Where each shown min and max came from (``meta.extremes``), step by step."""
    print("\nwhere each min and max came from (stat(ids=) names the sample):")
    shown = 0
    for key in keys:
        for s in steps:
            where = s["meta"].get("extremes", {}).get(key)
            if where is None:
                continue
            shown += 1
            print(f"{key:<{width}}  step {s['step']}: {where_text(where)}")
    if not shown:
        print("(none: the journal names no min or max source for these keys and steps)")


def cmd_plot(args: argparse.Namespace) -> None:
    steps = load_steps(args.target)
    fig, series, rows, cols = plot_steps(steps, select_keys(steps, args.keys))
    out = Path(args.output)
    if not out.parent.exists():
        raise CliError(f"cannot write {out}: no folder {out.parent}")
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(series)} plots in a {rows}x{cols} grid, {len(steps)} steps)")


def plot_steps(steps: list[dict[str, Any]], keys: list[str]) -> tuple[Any, list, int, int]:
    """Draw a grid of one plot per key (its min-max band where it has one) over the steps;
    return ``(figure, series, rows, cols)``. Steps are integers on every x axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CliError("plot needs matplotlib: pip install 'metricsvc[plot]'") from None
    series = _plot_series(keys)
    cols = min(4, len(series))
    rows = -(-len(series) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows + 0.6),
                             squeeze=False, sharex=True)
    xs = [s["step"] for s in steps]
    partial = [s["step"] for s in steps if s["meta"].get("partial")]
    for ax, (label, mean_key, band) in zip(axes.flat, series):
        ys = [_num(s["metrics"].get(mean_key)) for s in steps]
        ax.plot(xs, ys, marker=".", color="tab:blue")
        if band:
            lo = [_num(s["metrics"].get(band[0])) for s in steps]
            hi = [_num(s["metrics"].get(band[1])) for s in steps]
            ax.fill_between(xs, lo, hi, alpha=0.2, color="tab:blue")
        for step in partial:
            ax.axvline(step, color="tab:red", alpha=0.3, linestyle="--")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 0.5
        ax.tick_params(labelbottom=True)  # every panel labels its steps, not the last row
        ax.set_title(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    legend = [Line2D([], [], color="tab:blue", marker=".", label="mean (or the value)"),
              Patch(color="tab:blue", alpha=0.2, label="min to max over every rank's values")]
    if partial:
        legend.append(Line2D([], [], color="tab:red", linestyle="--", label="partial step"))
    fig.legend(handles=legend, loc="upper center", ncol=len(legend), fontsize=8,
               frameon=False)
    fig.supxlabel("step", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (2.6 * rows + 0.6)))
    return fig, series, rows, cols


def _num(value: Any) -> float:
    return value if isinstance(value, (int, float)) else math.nan


def _plot_series(keys: list[str]) -> list[tuple[str, str, tuple[str, str] | None]]:
    """Group ``x/mean`` (or ``x/avg``) with ``x/min`` and ``x/max`` into one banded series."""
    present, used, out = set(keys), set(), []
    for key in keys:
        base, _, last = key.rpartition("/")
        if last in ("mean", "avg") and {f"{base}/min", f"{base}/max"} <= present:
            out.append((base, key, (f"{base}/min", f"{base}/max")))
            used |= {key, f"{base}/min", f"{base}/max"}
    out += [(k, k, None) for k in keys if k not in used]
    return out


def cmd_health(args: argparse.Namespace) -> None:
    import ray

    if args.address != "auto":  # ray.init would retry an unreachable address for minutes
        host, _, port = args.address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as err:
            raise CliError(f"cannot connect to Ray at {args.address}: {err}") from None
    _use_token_if_available()
    try:
        ray.init(address=args.address, namespace=args.namespace, log_to_driver=False,
                 logging_level="ERROR")
    except Exception as err:
        raise CliError(f"cannot connect to Ray at {args.address}: {err}") from None
    try:
        worker = ray.get_actor(args.name, namespace=args.namespace)
    except ValueError:
        found = sorted({a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"] == args.name})
        hint = (f"; it runs in namespace {', '.join(found)}: pass --namespace" if found
                else "; is it started, and under this --name?")
        raise CliError(f"no MetricWorker named {args.name!r} in namespace "
                       f"{args.namespace!r}{hint}") from None
    health = ray.get(worker.health.remote(), timeout=30)
    print(json.dumps(health, indent=2, default=str) if args.json else health_summary(health))


def _use_token_if_available() -> None:
    """Present this machine's Ray token, as ``ray status`` does: Ray turns token auth on by
    itself only for a cluster it finds without an address, not for ``--address``. Never
    turns authentication off; an explicit ``RAY_AUTH_MODE`` is respected."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def health_summary(h: dict[str, Any]) -> str:
    """Return the few lines a person needs from ``health()``."""
    lines = [f"MetricWorker {h['name']!r} pid {h['pid']}, up {h['uptime_s']:.0f} s; "
             f"run folder {h['run_dir']}",
             f"world size {h.get('world_size') or 'not agreed yet'}"
             f"{' (' + h['world_size_source'] + ')' if h.get('world_size_source') else ''}; "
             f"last final step {h['last_final_step']}"]
    for step, p in h["pending_steps"].items():
        missing = sorted(set(range(p["world_size"])) - set(p["closed"]))
        lines.append(f"  step {step} waits for ranks {missing} ({len(p['closed'])} of "
                     f"{p['world_size']} closed)")
    lines.append(f"batches {h['batches']}, rejected {h['rejected_batches']}, late "
                 f"{h['late_batches']}{' ' + str(h['late_by_rank']) if h['late_by_rank'] else ''}"
                 f", conflicting {h['conflicting_batches']}, partial steps {h['partial_steps']}")
    for name, sink in h["sinks"].items():
        state = "FAILING" if sink["failing"] else "ok"
        extra = f"; last error: {sink['last_error']}" if sink["failing"] else ""
        lines.append(f"  sink {name}: {state}, written {sink['written']}, dead-lettered "
                     f"{sink['dead_lettered']}{extra}")
    return "\n".join(lines)


def cmd_validate_config(args: argparse.Namespace) -> None:
    cfg = load_config(args.file)
    from metricsvc.sinks.base import build_sinks

    # a sink whose library is missing, a custom target or entry point that cannot load
    build_sinks(cfg.sinks, check=True)
    data = json.loads(cfg.model_dump_json())
    print(yaml.safe_dump(Redactor(data).value(data), sort_keys=False), end="")
    print(f"# {args.file}: valid", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> None:
    from metricsvc.cli.demo import run_demo  # the demo runs ranks, so it needs the client

    run_demo(args.config, ranks=args.ranks, steps=args.steps)


# -- entry point -------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``metricsvc report: error: ...``) and exit status 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="metricsvc", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"metricsvc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    names = ", ".join(presets())
    demo = sub.add_parser("demo", help="local Ray, the MetricWorker, ranks, finished steps",
                          description="Run training ranks with fake PPO batches on Ray (a running "
                                      "cluster if there is one, else a local one).")
    demo.add_argument("--config", default=None,
                      help=f"a preset ({names}) or a YAML file (default: the demo's own: "
                           "console every 5 steps and the journal, under ./runs)")
    demo.add_argument("--ranks", "--workers", dest="ranks", type=positive, default=4,
                      help="training ranks (siiRL's DAG workers) to run (default 4)")
    demo.add_argument("--steps", type=positive, default=20, help="steps to run (default 20)")
    report = sub.add_parser("report", help="a readable table of a run's journal")
    report.add_argument("target", metavar="RUN_DIR_OR_JOURNAL",
                        help="a run folder (its newest journal is read) or a metrics.jsonl")
    report.add_argument("--keys", nargs="+", help="glob patterns, e.g. 'critic/*'")
    report.add_argument("--last", type=positive, default=5,
                        help="last N steps (default 5; the output says how many it shows)")
    report.add_argument("--extremes", action="store_true",
                        help="also print the rank and sample each min and max came from")
    report.add_argument("--top", action="store_true",
                        help="also print the k smallest and largest samples of each shown "
                             "min and max recorded with stat(top=k)")
    report.add_argument("--nonfinite", action="store_true",
                        help="also print where each key's first non-finite value (NaN, inf) "
                             "came from")
    report.add_argument("--alerts", action="store_true",
                        help="also print every alert of the run and the samples it names")
    plot = sub.add_parser("plot", help="line plots of chosen keys over steps")
    plot.add_argument("target", metavar="RUN_DIR_OR_JOURNAL",
                      help="a run folder (its newest journal is read) or a metrics.jsonl")
    plot.add_argument("--keys", nargs="+", required=True, help="glob patterns")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    health = sub.add_parser("health", help="print a running MetricWorker's health",
                            description="Connect to a running Ray cluster (as `ray status` "
                                        "does, with this machine's Ray token) and print the "
                                        "MetricWorker's health.")
    health.add_argument("--name", default=DEFAULT_NAME,
                        help=f"the service's actor name (default {DEFAULT_NAME})")
    health.add_argument("--namespace", default=default_namespace(),
                        help=f"its Ray namespace (default ${NAMESPACE_ENV}, else metricsvc)")
    health.add_argument("--address", default="auto",
                        help="the cluster's GCS address, host:port as `ray status` shows it "
                             "(default: the cluster running on this machine)")
    health.add_argument("--json", action="store_true", help="the full health() as JSON")
    validate = sub.add_parser("validate-config", help="validate a config, print it resolved")
    validate.add_argument("file", help=f"a YAML file or a preset ({names})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = {"demo": cmd_demo, "report": cmd_report, "plot": cmd_plot, "health": cmd_health,
               "validate-config": cmd_validate_config}[args.command]
    try:
        handler(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `metricsvc report RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    except (CliError, ValueError, OSError, KeyError) as err:
        print(f"metricsvc {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # never a traceback at the user: one line, non-zero
        cause = getattr(err, "cause", None)  # a task's error, as Ray wraps it
        err = cause if isinstance(cause, BaseException) else err
        print(f"metricsvc {args.command}: error: {type(err).__name__}: {one_line(err)}",
              file=sys.stderr)
        return 1
    return 0


def one_line(err: BaseException) -> str:
    """The message of ``err`` as one line: its last non-empty line (where a multi-line
    message, such as a remote traceback, ends with what went wrong)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
