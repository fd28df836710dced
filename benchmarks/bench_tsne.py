"""State-map t-SNE: the workbench's openTSNE path vs ``sklearn.manifold.TSNE``, time and quality.

Usage::

    .venv/bin/python benchmarks/bench_tsne.py                    # 20k states, all methods
    .venv/bin/python benchmarks/bench_tsne.py --n 5000 --skip-sklearn

One run, one set of states: generated finance episodes (``core.data.datasets.generate``)
until there are ``--n`` steps, their raw state features (``core.state.features``), encoded to
512-d by the seeded state encoder.  Every method gets the same states and the same
PCA-50 first:

* ``opentsne-tuned``   — :func:`core.state.statemap.tsne_map` with its defaults (exact
  neighbours by one BLAS product up to 30k states, FFT gradients, PCA initialisation,
  perplexity 40, 100 + 150 iterations, 2 threads);
* ``opentsne-default`` — openTSNE's own defaults (perplexity 30, annoy, 250 + 500
  iterations), for reference;
* ``sklearn``          — ``sklearn.manifold.TSNE`` (Barnes-Hut, PCA init, perplexity 30,
  its defaults).

Quality is ``sklearn.manifold.trustworthiness`` (k = 10) of the 2-D map against the
512-d states, on the same three disjoint random subsamples (``--trust-sample`` states
each) for every method; the mean is reported with the three values, whose spread
(~0.001) is the noise of the measure.
Finally ``transform``: a map fitted on all but ``--new`` states places the last
``--new`` ones (openTSNE's ``transform``), against recomputing the whole map.

Targets (issue 4): ≤ 30 s for 20k states on 2 cores, and ≥ 5× faster than sklearn at
equal or better trustworthiness.  Timings on a shared machine are noisy: the load
average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.records.catalog import build_catalog  # noqa: E402
from core.data.datasets import generate  # noqa: E402
from core.base.embed import Embedder  # noqa: E402
from core.state.features import encode_states, extract_features  # noqa: E402
from core.state.statemap import TsneConfig, tsne_map, tsne_map_sklearn  # noqa: E402

TARGET_SECONDS, TARGET_SPEEDUP = 30.0, 5.0


def encoded_states(n: int, seed: int, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """[n, 512] encoded states of generated finance episodes, and each step's task type."""
    episodes = []
    n_eps = max(1, n // 5)
    while sum(e.n_steps for e in episodes) < n:
        episodes = generate("finance", n_eps, seed).episodes
        n_eps = int(n_eps * 1.3) + 1
    tools = generate("finance", 1, seed).tools
    t0 = time.perf_counter()
    raw = extract_features(episodes, build_catalog(tools, episodes), Embedder(cache / "embeddings"))
    X = encode_states(raw)[:n]
    labels = np.array([episodes[e].task.task_type for e in raw.step_episode[:n]])
    print(f"states: {X.shape[0]} × {X.shape[1]} from {len(episodes)} episodes "
          f"({time.perf_counter() - t0:.1f} s to featurise and encode)")
    return X, labels


def trust(X: np.ndarray, Y: np.ndarray, samples: list[np.ndarray], k: int = 10) -> list[float]:
    """Trustworthiness of the map ``Y`` of ``X`` on each subsample."""
    from sklearn.manifold import trustworthiness

    return [float(trustworthiness(X[s], Y[s], n_neighbors=k)) for s in samples]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="number of states to map")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data, encoder and maps")
    ap.add_argument("--trust-sample", type=int, default=3000, help="subsample for trustworthiness")
    ap.add_argument("--new", type=int, default=2000, help="states added with transform")
    ap.add_argument("--skip-sklearn", action="store_true", help="leave out sklearn (slow)")
    ap.add_argument("--skip-default", action="store_true", help="leave out openTSNE's defaults")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "rwb-bench-tsne",
                    help="embedding cache folder")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    X, labels = encoded_states(args.n, args.seed, args.cache)
    order = np.random.default_rng(args.seed).permutation(len(X))
    size = min(args.trust_sample, len(X) // 3)
    samples = [np.sort(order[i * size:(i + 1) * size]) for i in range(3)]
    tuned = TsneConfig(seed=args.seed)
    results: dict[str, dict] = {}

    def record(name: str, seconds: float, cpu: float, Y: np.ndarray, **extra) -> dict:
        tw = trust(X, Y, samples)
        results[name] = {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
                         "trustworthiness": round(float(np.mean(tw)), 4),
                         "trustworthiness_samples": [round(x, 4) for x in tw], **extra}
        print(f"{name:<18} {seconds:8.1f} s wall {cpu:8.1f} s CPU   trustworthiness {np.mean(tw):.4f} "
              f"({', '.join(f'{x:.4f}' for x in tw)})", flush=True)
        return results[name]

    def timed(fn):
        """(result, wall seconds, CPU seconds of all threads): on a shared machine the CPU
        time is the steadier figure (wall ≥ CPU / threads when the cores are free)."""
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - w, time.process_time() - c

    fitted, wall, cpu = timed(lambda: tsne_map(X, tuned))
    record("opentsne-tuned", wall, cpu, fitted.coords, config=asdict(tuned))
    if not args.skip_default:
        default = TsneConfig(seed=args.seed, perplexity=30, early_exaggeration_iter=250, n_iter=500,
                             neighbors="annoy", negative_gradient_method="fft", n_jobs=2)
        fitted_default, wall, cpu = timed(lambda: tsne_map(X, default))
        record("opentsne-default", wall, cpu, fitted_default.coords, config=asdict(default))
    if not args.skip_sklearn:
        Y, wall, cpu = timed(lambda: tsne_map_sklearn(X, TsneConfig(seed=args.seed, perplexity=30, n_jobs=2)))
        record("sklearn", wall, cpu, Y)

    # adding states to an existing map
    if args.new and args.new < len(X):
        base = tsne_map(X[:-args.new], tuned)
        placed, wall, cpu = timed(lambda: base.transform(X[-args.new:]))
        r = record("transform", wall, cpu, np.concatenate([base.coords, placed]), new_states=args.new)
        print(f"{'':<18} ({args.new} new states placed on a map of {len(X) - args.new}, "
              f"instead of recomputing the whole map; trustworthiness of the combined map "
              f"{r['trustworthiness']:.4f})")

    load = os.getloadavg()
    summary = {"n": len(X), "dims": int(X.shape[1]), "cpus": os.cpu_count(), "load_average": load,
               "trust_sample": size, "results": results}
    tuned_r = results["opentsne-tuned"]
    print(f"\nload average during the run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"target ≤ {TARGET_SECONDS:.0f} s: {'met' if tuned_r['seconds'] <= TARGET_SECONDS else 'missed'} "
          f"({tuned_r['seconds']:.1f} s)")
    if "sklearn" in results:
        sk = results["sklearn"]
        speedup = sk["seconds"] / tuned_r["seconds"]
        cpu_speedup = sk["cpu_seconds"] / tuned_r["cpu_seconds"]
        summary["speedup_vs_sklearn"] = round(speedup, 2)
        summary["cpu_speedup_vs_sklearn"] = round(cpu_speedup, 2)
        print(f"speed-up vs sklearn: {speedup:.1f}× wall, {cpu_speedup:.1f}× CPU (target ≥ "
              f"{TARGET_SPEEDUP:.0f}×), trustworthiness {tuned_r['trustworthiness']:.4f} vs "
              f"{sk['trustworthiness']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
