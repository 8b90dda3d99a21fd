"""Per-program cost of the code sandbox: one `run_python` call under bubblewrap, against the same
program started as a bare interpreter and under the weaker process-only mode.

    python bench/sandbox.py [--runs 41]

Rows (median of --runs runs, after one warm-up, interleaved so drift hits every row alike), each
as wall time and as CPU time of the processes it started (user + system, from RUSAGE_CHILDREN: on
a loaded machine wall time is mostly waiting for a CPU, CPU time is not):
`bare python`: `python -I -S -c SRC` through subprocess (what starting any interpreter costs);
`process-only`: run_python in the weaker mode (rlimits + audit hook, host temp dir);
`bubblewrap`: run_python as the code env runs it. The overhead is bubblewrap minus bare python.
Programs: `pass`, and an `import numpy` one (what a numpy solution pays on top).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402
from ridgeline.envs.sandbox import ProcessOnly, SandboxLimits, SandboxSettings, resolve_isolation, run_python  # noqa: E402

PROGRAMS = {"pass": "pass", "numpy": "import numpy\nprint(int(numpy.arange(10).sum()))"}
LIMITS = SandboxLimits(wall_seconds=30, cpu_seconds=30)


def bare(interpreter: str, site: list[str], source: str) -> None:
    # -S as the sandbox runs it; numpy's folder on sys.path the way the sandbox puts /packages there
    code = f"import sys; sys.path[:0] = {site!r}\n" + source
    subprocess.run([interpreter, "-I", "-S", "-c", code], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=41)
    args = parser.parse_args()
    bwrap = resolve_isolation(SandboxSettings())
    process = ProcessOnly()
    import numpy

    site = [str(Path(numpy.__file__).parents[1])]
    wall = {(kind, name): [] for kind in ("bare python", "process-only", "bubblewrap") for name in PROGRAMS}
    cpu = {key: [] for key in wall}
    calls = {
        "bare python": lambda source: bare(bwrap.interpreter, site, source),
        "process-only": lambda source: run_python(source, "", LIMITS, process),
        "bubblewrap": lambda source: run_python(source, "", LIMITS, bwrap),
    }
    load_before = os.getloadavg()[0]
    for round_ in range(args.runs + 1):
        for name, source in PROGRAMS.items():
            for kind, call in calls.items():
                before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
                result = call(source)
                elapsed, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
                if result is not None and not result.ok:
                    raise SystemExit(f"{kind} {name}: the program failed: {result}")
                if round_:  # round 0 warms the page cache
                    wall[(kind, name)].append(elapsed)
                    cpu[(kind, name)].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    load = (load_before + os.getloadavg()[0]) / 2
    ms = {what: {f"{kind} / {name}": statistics.median(times) * 1000 for (kind, name), times in table.items()}
          for what, table in (("wall", wall), ("cpu", cpu))}
    for key in ms["wall"]:
        print(f"{key:28s} wall {ms['wall'][key]:7.1f} ms   cpu {ms['cpu'][key]:6.1f} ms")
    overhead = {what: {name: ms[what][f"bubblewrap / {name}"] - ms[what][f"bare python / {name}"] for name in PROGRAMS}
                for what in ms}
    w, c = ms["wall"], ms["cpu"]
    summary = (f"median of {args.runs}, wall (CPU): `pass` bare python {w['bare python / pass']:.1f} "
               f"({c['bare python / pass']:.1f}) ms, process-only {w['process-only / pass']:.1f} "
               f"({c['process-only / pass']:.1f}) ms, bubblewrap {w['bubblewrap / pass']:.1f} ({c['bubblewrap / pass']:.1f}) ms, "
               f"overhead {overhead['wall']['pass']:.1f} ({overhead['cpu']['pass']:.1f}) ms; `import numpy` bare "
               f"{w['bare python / numpy']:.1f} ({c['bare python / numpy']:.1f}) ms, bubblewrap {w['bubblewrap / numpy']:.1f} "
               f"({c['bubblewrap / numpy']:.1f}) ms; load average {load:.1f}; bwrap {'.'.join(map(str, bwrap.version))}, "
               f"{'as root: two bwraps + setpriv' if bwrap.setpriv else 'one bwrap'}")
    write_result("sandbox", {"runs": args.runs, "median_ms": ms, "overhead_ms": overhead, "load_average": load,
                             "bwrap_version": list(bwrap.version), "root_path": bwrap.setpriv is not None}, summary)


if __name__ == "__main__":
    main()
