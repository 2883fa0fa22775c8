#!/usr/bin/python3
"""Plot the fidelity report: KL(full || evicted) against the KV memory each row keeps, one panel per family.

Usage: plot.py fidelity.csv out.png [TEXT]    (TEXT names the excerpts' source in the title; default
"Sherlock Holmes")
Reads the CSV written by kvevict_fidelity (method, keep_fraction, prompts, kl_mean, kv_bytes, reference,
kl_diff_ref_se, ...).

- x: kept fp32 K+V bytes per sequence (KiB, all layers), so a per-query-head row (on a cache repeated to
  q_heads: "-pqh", AdaKV-pub) sits at G times the memory of the GQA-native row of the same keep fraction;
  y: mean KL per token over the excerpts. Both axes logarithmic.
- Error bars: +- the standard error of the paired difference to the reference row (the CSV's
  reference column, SnapKV by default), the uncertainty the report's comparisons use; the reference row
  itself has none.
- Panels: training-free methods on the GQA cache (window-attention scores; other scores; the 2026
  methods: DefensiveKV, Layer-DefensiveKV, threshold budgets); the published per-query-head forms; learned rows (LKV); references (greedy searches, the random floor), each with the
  reference row drawn in grey for scale.
  At most 8 rows per panel, each a distinct colour and marker.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MARKERS = ["o", "s", "^", "v", "D", "P", "X", "<"]
MAX_PER_PANEL = 8


def family(name):
    if name.startswith("Greedy") or name == "Random":
        return "references: greedy searches and the random floor"
    if "LKV" in name:
        return "learned (LKV; trained on other Sherlock excerpts)"
    if name.endswith("-pqh") or name == "AdaKV-pub":
        return "published per-query-head forms (G x the memory)"
    if name in ("H2O", "TOVA", "StreamingLLM", "KeyNorm"):
        return "training-free, other scores (GQA cache)"
    if "DefensiveKV" in name or name.startswith("Threshold") or name.endswith("-def"):
        return "2026: defensive aggregation, layer-wide and threshold budgets"
    return "training-free, window attention (GQA cache)"


FAMILIES = ["training-free, window attention (GQA cache)", "training-free, other scores (GQA cache)",
            "2026: defensive aggregation, layer-wide and threshold budgets",
            "published per-query-head forms (G x the memory)", "learned (LKV; trained on other Sherlock excerpts)",
            "references: greedy searches and the random floor"]


def main(argv):
    if len(argv) not in (3, 4):
        sys.stderr.write("usage: plot.py fidelity.csv out.png [TEXT]\n")
        return 2
    text = argv[3] if len(argv) == 4 else "Sherlock Holmes"
    rows = list(csv.DictReader(open(argv[1], newline="")))
    if not rows:
        sys.stderr.write("plot.py: %s has no rows\n" % argv[1])
        return 1
    methods = []
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
    ref = next((r["reference"] for r in rows if r.get("reference")), "")
    prompts = rows[0]["prompts"]

    def series(m):
        pts = sorted((float(r["kv_bytes"]) / 1024.0, float(r["kl_mean"]), float(r.get("kl_diff_ref_se") or 0.0))
                     for r in rows if r["method"] == m)
        return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]

    panels = {f: [m for m in methods if family(m) == f and m != ref] for f in FAMILIES}
    if ref and family(ref) in panels:
        panels[family(ref)].insert(0, ref)
    shown = [f for f in FAMILIES if panels[f]]
    ncol = min(3, len(shown))
    nrow = (len(shown) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.4 * ncol, 4.6 * nrow), sharey=True, squeeze=False)
    flat = [a for row in axes for a in row]
    for a in flat[len(shown):]:
        a.axis("off")
    cmap = plt.get_cmap("tab10")
    left_out = []
    lo, hi = float("inf"), 0.0
    for ax, f in zip(flat, shown):
        names = panels[f]
        if len(names) > MAX_PER_PANEL:
            left_out += names[MAX_PER_PANEL:]
            names = names[:MAX_PER_PANEL]
        if ref and ref not in names:  # the reference row for scale, in grey
            x, y, _ = series(ref)
            ax.plot(x, y, color="0.6", linestyle="-", linewidth=2.5, alpha=0.6, label="%s (reference)" % ref)
        for i, m in enumerate(names):
            x, y, e = series(m)
            style = dict(color=cmap(i), marker=MARKERS[i % len(MARKERS)], linestyle="-" if i < 4 else "--")
            if m == ref:
                style = dict(color="0.4", marker="o", linestyle="-")
            # a log axis cannot show a bar below 0: the lower bar stops at 5% of the value (the upper is whole)
            err = None if m == ref else [[min(se, 0.95 * v) for se, v in zip(e, y)], e]
            ax.errorbar(x, y, yerr=err, label=m + (" (reference)" if m == ref else ""), linewidth=1.5,
                        capsize=2.5, markersize=5, **style)
            lo, hi = min([lo] + [v for v in y if v > 0]), max([hi] + y)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("kept fp32 K+V per sequence (KiB, all layers)")
        ax.set_title(f, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    for row in axes:
        row[0].set_ylabel("mean KL(full || evicted) per token (nats)")
    if hi > 0:
        flat[0].set_ylim(lo / 2, hi * 2)  # shared by every panel
    note = "error bars: +- s.e. of the paired KL difference to %s over the excerpts" % ref if ref else "no reference row"
    if left_out:
        note += "; not drawn (more than %d in a panel): %s" % (MAX_PER_PANEL, ", ".join(left_out))
    fig.suptitle("kvevict fidelity on stories260K: %s excerpts of %s, one-shot eviction after prefill\n%s" % (prompts, text, note),
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(argv[2], dpi=100)
    print("wrote %s" % argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
