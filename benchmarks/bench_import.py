"""What importing the client costs a training rank, over ``import ray`` alone.

    python -m benchmarks.bench_import [--repeats 15]

Each measurement is a fresh interpreter under ``python -X importtime``: the cumulative
microseconds of ``import ray`` in one, and of ``metricsvc.client`` imported after ray in
another (what a rank pays on top of Ray). Bytecode is cached under a temporary
``PYTHONPYCACHEPREFIX`` (warmed first), as an installed wheel has it. Prints medians, and
which of the package's modules the client import loads.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile


def cumulative_us(statement: str, module: str, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", statement],
                         capture_output=True, text=True, env=env, check=True)
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", line)
        if m and m.group(2) == module:
            value = int(m.group(1))
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        cumulative_us("import ray, metricsvc.client", "metricsvc.client", env)  # warm caches
        ray_us, client_us, numpy_us = [], [], []
        for _ in range(args.repeats):
            ray_us.append(cumulative_us("import ray", "ray", env))
            client_us.append(cumulative_us("import ray, metricsvc.client", "metricsvc.client",
                                           env))
            numpy_us.append(cumulative_us("import ray, numpy", "numpy", env))
        loaded = subprocess.run(
            [sys.executable, "-c", "import sys, ray; before = set(sys.modules); "
             "import metricsvc.client; new = set(sys.modules) - before; "
             "print(len(new), sorted(m for m in new if m.startswith('metricsvc')).__len__(), "
             "'pydantic' in sys.modules)"], capture_output=True, text=True, env=env,
            check=True).stdout.split()
    med = statistics.median
    print(f"| import | median ms ({args.repeats} fresh interpreters) |")
    print("|---|---:|")
    print(f"| `import ray` | {med(ray_us) / 1e3:.1f} |")
    print(f"| `import metricsvc.client`, after ray | {med(client_us) / 1e3:.1f} |")
    print(f"| of which numpy (a dependency ray does not import) | {med(numpy_us) / 1e3:.1f} |")
    print(f"\nthe client import loads {loaded[0]} modules past ray's, {loaded[1]} of them "
          f"metricsvc's; pydantic loaded: {loaded[2]}")


if __name__ == "__main__":
    main()
