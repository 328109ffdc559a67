"""Print the latest run of a benchmark CSV as a Markdown table (for the README).

    python benchmarks/table.py benchmarks/results/cpu.csv
    python benchmarks/table.py benchmarks/results/gpu.csv
"""

import csv
import sys


def main(path):
    rows = list(csv.DictReader(open(path)))
    latest = {}
    for r in rows:                      # the latest run of each shape
        latest[r["shape"]] = max(latest.get(r["shape"], ""), r["timestamp"])
    rows = [r for r in rows if r["timestamp"] == latest[r["shape"]]]
    # bench_gpu.py writes milliseconds and peak beyond inputs; bench_cpu.py seconds and peak
    # beyond the gradients
    unit, digits, peak = (("ms", 1, "inputs") if "median_ms" in rows[0] else ("s", 3, "grads"))
    print(f"| shape | provider | time ({unit}) median [p20, p80] | × floor | peak beyond {peak} "
          "(MiB) | × one fp32 [N,V] |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['shape']} | {r['provider']} | {r['status'].strip()[:60]} | | | |")
            continue
        t = [float(r[f"{q}_{unit}"]) for q in ("median", "p20", "p80")]
        print(f"| {r['shape']} | {r['provider']} | {t[0]:.{digits}f} "
              f"[{t[1]:.{digits}f}, {t[2]:.{digits}f}] | {r['ratio_to_floor']} | "
              f"{r['peak_extra_mb']} | {r.get('peak_over_logits', '')} |")

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cpu.csv")
