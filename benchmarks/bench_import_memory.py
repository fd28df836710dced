"""Peak memory of ``rwb episodes import`` against the size of the file imported.

Usage::

    .venv/bin/python benchmarks/bench_import_memory.py                    # 200 MB and 1 GB, rwb
    .venv/bin/python benchmarks/bench_import_memory.py --sizes 200 --formats rwb,openai,openai-list

Each file is generated (finance episodes from ``core.data.datasets.generate``, repeated with
new ids until the file has the size asked for) and imported by ``rwb episodes import`` into
a fresh workspace, in a fresh process; that process reports its own peak resident memory
(``ru_maxrss``) and its import workers' (``--workers``, default ``$RWB_IMPORT_WORKERS`` or 1).
The baseline is the same import of a one-episode file: what the interpreter and the
workbench's modules take whatever the file.  Printed: the peak, the peak over the
baseline, and both as a multiple of the file's size.

Goal (issue 28): peak ≤ 2× a 200 MB file's size, then ≤ 500 MB whatever the file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Formats this script writes: the workbench's JSON Lines, and OpenAI logs as JSON Lines or as one JSON list.
FORMATS = ("rwb", "openai", "openai-list")
GOAL_RATIO_200MB = 2.0
GOAL_PEAK_MB = 500

# The import, run by the workbench's own CLI inside a process that then reports its peak memory.
_RUN_IMPORT = """
import resource, sys
from core.cli import console
sys.argv = ["rwb", *sys.argv[1:]]
try:
    console()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code, file=sys.stderr)
"""


@dataclass
class Peak:
    """One import's peak resident memory, in bytes (``workers``: the largest import worker's)."""

    main: int
    workers: int
    seconds: float
    result: dict


def write_episodes_file(path: Path, megabytes: float, format: str = "rwb", seed: int = 3) -> int:
    """Write about ``megabytes`` MB of finance episodes to ``path`` as ``format`` (see
    :data:`FORMATS`); returns the number of episodes.  A few hundred generated episodes are
    repeated with new ids (``<id>-r<k>``), so a big file costs seconds to write."""
    from core.data.datasets import generate

    ds = generate("finance", 300, seed)
    target = int(megabytes * 1_000_000)
    n = size = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        if format == "rwb":
            head, *texts = ds.lines()
            f.write(head + "\n")
            size += len(head) + 1
        else:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from bench_import import to_openai_record

            texts = [json.dumps(to_openai_record(ep, list(ds.tools) if i == 0 else []))
                     for i, ep in enumerate(ds.episodes)]
        ids = [ep.episode_id for ep in ds.episodes]
        key = '"episode_id":"{}"' if format == "rwb" else '"id": "{}"'
        listed = format == "openai-list"
        if listed:
            f.write("[\n")
        for k in range(10**9):
            for episode_id, text in zip(ids, texts):
                line = text.replace(key.format(episode_id), key.format(f"{episode_id}-r{k}"), 1)
                line = ((",\n" if n else "") + line) if listed else line + "\n"
                f.write(line)
                size += len(line)
                n += 1
                if size >= target:
                    break
            if size >= target:
                break
        if listed:
            f.write("\n]\n")
    return n


def peak_of_import(path: Path, workspace: Path, *args: str, workers: int = 1) -> Peak:
    """Import ``path`` with ``rwb episodes import --json`` into ``workspace`` in a fresh
    process; its peak memory."""
    env = dict(os.environ, RWB_IMPORT_WORKERS=str(workers), PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _RUN_IMPORT, "--workspace", str(workspace), "episodes", "import",
                          str(path), "--json", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - started
    peak_line = [line for line in out.stderr.splitlines() if line.startswith("PEAK ")]
    if not peak_line or peak_line[-1].split()[3] != "0":
        raise RuntimeError(f"import of {path} failed: {out.stderr[-2000:]}")
    _, main_kb, workers_kb, _ = peak_line[-1].split()
    return Peak(int(main_kb) * 1024, int(workers_kb) * 1024, seconds, json.loads(out.stdout))


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="200,1000", help="file sizes in MB, comma-separated")
    ap.add_argument("--formats", default="rwb", help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--workers", type=int, default=int(os.environ.get("RWB_IMPORT_WORKERS", "1") or 1),
                    help="import worker processes (rwb files)")
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; import workers: {args.workers}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for fmt in formats:
            extra = ["--id-key", "id"] if fmt != "rwb" else []
            tiny = folder / f"tiny.{fmt}.json"
            write_episodes_file(tiny, 0.001, fmt)
            base = peak_of_import(tiny, folder / f"ws-tiny-{fmt}", *extra, workers=args.workers)
            print(f"[{fmt}] baseline (one-episode file): peak {_mb(base.main)}")
            for size_mb in sizes:
                path = folder / f"episodes-{size_mb:g}mb.{fmt}.json"
                n = write_episodes_file(path, size_mb, fmt)
                size = path.stat().st_size
                peak = peak_of_import(path, folder / f"ws-{fmt}-{size_mb:g}", *extra, workers=args.workers)
                path.unlink()
                ratio = peak.main / size
                worst = max(worst, peak.main / 1e6)
                workers = f", largest worker {_mb(peak.workers)}" if args.workers > 1 else ""
                print(f"[{fmt}] {_mb(size)} ({n:,} episodes, {peak.result['steps']:,} steps): "
                      f"peak {_mb(peak.main)} = {ratio:.2f}x the file; over the baseline "
                      f"{_mb(peak.main - base.main)} = {(peak.main - base.main) / size:.2f}x; "
                      f"{peak.seconds:.0f}s{workers}")
                if abs(size_mb - 200) < 1:
                    verdict = "meets" if ratio <= GOAL_RATIO_200MB else "ABOVE"
                    print(f"  goal peak ≤ {GOAL_RATIO_200MB:g}x a 200 MB file: {verdict}")
    verdict = "meets" if worst <= GOAL_PEAK_MB else "ABOVE"
    print(f"goal peak ≤ {GOAL_PEAK_MB} MB whatever the file: {verdict} (largest peak {worst:,.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
