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
    if "median_ms" in rows[0]:          # bench_gpu.py
        print("| shape | provider | time (ms) median [p20, p80] | × floor | peak beyond inputs "
              "(MiB) | × one fp32 [N,V] |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["status"] != "ok":
                print(f"| {r['shape']} | {r['provider']} | {r['status'].strip()[:60]} | | | |")
                continue
            print(f"| {r['shape']} | {r['provider']} | {float(r['median_ms']):.1f} "
                  f"[{float(r['p20_ms']):.1f}, {float(r['p80_ms']):.1f}] | {r['ratio_to_floor']} | "
                  f"{r['peak_extra_mb']} | {r.get('peak_over_logits', '')} |")
        return
    print("| shape | provider | time (s) median [p20, p80] | × floor | peak beyond grads (MiB) "
          "| × one fp32 [N,V] |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['shape']} | {r['provider']} | {r['status']} | | | |")
            continue
        print(f"| {r['shape']} | {r['provider']} | {float(r['median_s']):.3f} "
              f"[{float(r['p20_s']):.3f}, {float(r['p80_s']):.3f}] | {r['ratio_to_floor']} | "
              f"{r['peak_extra_mb']} | {r['peak_over_logits']} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cpu.csv")
