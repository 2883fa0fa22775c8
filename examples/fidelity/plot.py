#!/usr/bin/python3
"""Plot the fidelity report: KL(full || evicted) vs keep fraction, one line per method (left), and the
mean per-layer relative attention-output error at the first decoding step (right).

Usage: plot.py fidelity.csv out.png
Reads the CSV written by kvevict_fidelity (columns method, keep_fraction, kl_mean, oerr_mean, ...).
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot.py fidelity.csv out.png\n")
        return 2
    rows = list(csv.DictReader(open(argv[1], newline="")))
    if not rows:
        sys.stderr.write("plot.py: %s has no rows\n" % argv[1])
        return 1
    methods = []
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
    prompts = rows[0]["prompts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"Oracle": dict(color="black", linestyle="--"), "Random": dict(color="grey", linestyle=":")}
    for m in methods:
        pts = sorted((float(r["keep_fraction"]), float(r["kl_mean"]), float(r["oerr_mean"])) for r in rows if r["method"] == m)
        x = [100 * p[0] for p in pts]
        kw = styles.get(m, {})
        lw = 2.4 if m == "ReST-KV" else 1.4
        ax1.plot(x, [p[1] for p in pts], marker="o", label=m, linewidth=lw, **kw)
        ax2.plot(x, [p[2] for p in pts], marker="o", label=m, linewidth=lw, **kw)
    ax1.set_yscale("log")
    ax1.set_xlabel("KV kept per head (% of the prompt)")
    ax1.set_ylabel("mean KL(full || evicted) per token (nats)")
    ax1.set_title("next-token KL, teacher-forced continuation")
    ax2.set_yscale("log")
    ax2.set_xlabel("KV kept per head (% of the prompt)")
    ax2.set_ylabel("||o - o_ev|| / ||o||, mean over layers")
    ax2.set_title("attention-output error, first decoding step")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle("kvevict fidelity on stories260K (%s Sherlock Holmes excerpts, one-shot eviction after prefill)" % prompts, fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[2], dpi=110)
    print("wrote %s" % argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
