"""How far two sets of sweep timings agree: the ceiling of any ranker trained on one of them.

    python bench/sweeps/agreement.py STORE[@METHOD] STORE[@METHOD] [--out FILE.json]

METHOD selects a store's lines by their timing method: `launched` (GPU lines from before the batches were queued
behind a delay, sweep.GPU_TIMING), `queued`, or nothing for every line. Where a pair has several lines in a
selection, the last counts. For the (problem, kernel) pairs both selections timed, it reports:
- the ratio of B's time to A's per pair, by A's time (quantiles): a shift in one band of kernel lengths is the mark
  of a method that measured something else there (e.g. the host's launch pace below ~20 us);
- A's fastest kernel judged by B's times (B's best / B's time of A's pick, over problems with at least
  --min-kernels common kernels), and the reverse: a model trained on A cannot do better on B's times than A's
  own oracle does, so this is the noise ceiling of held-out scores.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import read_store  # noqa: E402
from train import summary  # noqa: E402

BANDS_MS = (0.01, 0.02, 0.05, 0.2, 1.0, float("inf"))  # upper edges of the kernel-length bands
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def selected(spec: str) -> tuple[str, dict]:
    """{problem_id: {kernel: ms}} of the lines of STORE[@METHOD]."""
    path, _, method = spec.partition("@")
    if method not in ("", "launched", "queued"):
        raise SystemExit(f"{spec}: the method is launched or queued, not {method!r}")
    times: dict = defaultdict(dict)
    for row in read_store(Path(path))[1]:
        if row.get("ms") is None:
            continue
        if method and (row.get("timing") or "launched") != method:
            continue
        times[row["problem_id"]][row["kernel"]] = row["ms"]
    if not times:
        raise SystemExit(f"{spec}: no timed lines")
    return spec, times


def quantiles(values: list[float]) -> dict:
    v = sorted(values)
    return {f"p{round(q * 100)}": v[min(len(v) - 1, int(q * len(v)))] for q in QUANTILES}


def oracle_agreement(a: dict, b: dict, min_kernels: int) -> dict:
    """A's fastest kernel of each problem, judged by B's times."""
    effs = []
    for pid, times_a in a.items():
        common = set(times_a) & set(b.get(pid, ()))
        if len(common) < min_kernels:
            continue
        pick = min(sorted(common), key=times_a.get)
        effs.append(min(b[pid][k] for k in common) / b[pid][pick])
    return summary(effs)  # as train.py scores a ranker's picks


def agreement(a: dict, b: dict, min_kernels: int = 2) -> dict:
    bands = defaultdict(list)
    for pid, times_a in a.items():
        for kernel, ms in times_a.items():
            other = b.get(pid, {}).get(kernel)
            if other is not None:
                bands[next(edge for edge in BANDS_MS if ms < edge)].append(other / ms)
    return {"pairs": sum(len(v) for v in bands.values()),
            "b_over_a_by_a_time": [{"below_ms": edge if edge != float("inf") else None, "pairs": len(bands[edge]),
                                    **quantiles(bands[edge])} for edge in BANDS_MS if bands[edge]],
            "a_oracle_on_b": oracle_agreement(a, b, min_kernels), "b_oracle_on_a": oracle_agreement(b, a, min_kernels)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="STORE[@launched|@queued]")
    ap.add_argument("b", help="STORE[@launched|@queued]")
    ap.add_argument("--min-kernels", type=int, default=2, help="problems with fewer common kernels are left out")
    ap.add_argument("--out", help="write the result as JSON here too")
    args = ap.parse_args(argv)
    (name_a, a), (name_b, b) = selected(args.a), selected(args.b)
    result = {"a": name_a, "b": name_b, **agreement(a, b, args.min_kernels)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
