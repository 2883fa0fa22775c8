#!/usr/bin/python3
"""Plot the fidelity report: KL(full || evicted) vs keep fraction with the standard error over the
excerpts as error bars (left), and the mean per-layer relative attention-output error at the first
decoding step (right).

Usage: plot.py fidelity.csv out.png [TEXT]    (TEXT names the excerpts' source in the title; default
"Sherlock Holmes")
Reads the CSV written by kvevict_fidelity (columns method, keep_fraction, kl_mean, kl_se, oerr_mean, ...).

Every row has a style of its own: training-free methods solid lines, learned (LKV) rows dashed, the
per-query-head rows (on a cache repeated to q_heads: "-pqh", AdaKV-pub) dotted in the colour of their
GQA-native row with a hollow marker, the oracles black and the random floor grey (references, not
methods); colour, marker and line together tell rows apart, so no two rows look the same.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MARKERS = ["o", "s", "^", "v", "D", "P", "X", "<", ">", "p", "h", "*", "d", "8"]


def is_learned(name):
    return "LKV" in name


def is_reference(name):
    return name.startswith("Greedy") or name == "Random"


def pqh_base(name):
    """The GQA-native row a per-query-head row is the repeated-cache form of, or None."""
    if name == "AdaKV-pub":
        return "AdaKV-mp7"
    return name[:-4] if name.endswith("-pqh") and not name.startswith("Greedy") else None


def styles_for(methods):
    """One (colour, marker, linestyle) per row: tab10 for training-free rows, Dark2 for the learned
    rows (dashed: no colour is shared with a training-free row of the same marker), black for the
    oracles, grey for the random floor."""
    cmap, lcmap = plt.get_cmap("tab10"), plt.get_cmap("Dark2")
    extra = ["navy", "maroon", "darkolivegreen", "indigo"]  # past tab10's 10 colours: no colour repeats

    def free_colour(i):
        return cmap(i) if i < 10 else extra[(i - 10) % len(extra)]

    out, free_i, learned_i, oracle_i = {}, 0, 0, 0
    for m in methods:
        if m == "Random":
            out[m] = dict(color="grey", marker="x", linestyle=":")
        elif m.startswith("Greedy"):
            out[m] = dict(color="black", marker=["*", "X", "+"][oracle_i % 3], linestyle=["--", "-.", ":"][oracle_i % 3])
            oracle_i += 1
        elif is_learned(m):
            out[m] = dict(color=lcmap(learned_i % 8), marker=MARKERS[(learned_i + 7) % len(MARKERS)], linestyle="--")
            learned_i += 1
        elif pqh_base(m) is None:
            out[m] = dict(color=free_colour(free_i), marker=MARKERS[free_i % len(MARKERS)], linestyle="-")
            free_i += 1
    for m in methods:  # per-query-head rows: their GQA-native row's colour and marker, hollow and dotted
        b = pqh_base(m)
        if b is not None:
            base = out.get(b, dict(color=free_colour(free_i), marker=MARKERS[free_i % len(MARKERS)]))
            out[m] = dict(color=base["color"], marker=base["marker"], linestyle=":", markerfacecolor="none")
    return out


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
    prompts = rows[0]["prompts"]
    styles = styles_for(methods)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6))
    for m in methods:
        pts = sorted((float(r["keep_fraction"]), float(r["kl_mean"]), float(r.get("kl_se", 0) or 0), float(r["oerr_mean"]))
                     for r in rows if r["method"] == m)
        x = [100 * p[0] for p in pts]
        st = styles[m]
        lw = 2.2 if m in ("ReST-KV", "LKV") else 1.3
        ax1.errorbar(x, [p[1] for p in pts], yerr=[p[2] for p in pts], label=m, linewidth=lw, capsize=2.5, markersize=5,
                     **st)
        ax2.plot(x, [p[3] for p in pts], label=m, linewidth=lw, markersize=5, **st)
    ax1.set_yscale("log")
    ax1.set_xlabel("KV kept per head (% of the prompt)")
    ax1.set_ylabel("mean KL(full || evicted) per token (nats), +- s.e. over excerpts")
    ax1.set_title("next-token KL, teacher-forced continuation")
    ax2.set_yscale("log")
    ax2.set_xlabel("KV kept per head (% of the prompt)")
    ax2.set_ylabel("||o - o_ev|| / ||o||, mean over layers")
    ax2.set_title("attention-output error, first decoding step")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    # one legend for both panels, grouped: training-free, learned, references
    order = [m for m in methods if not is_learned(m) and not is_reference(m)] + [m for m in methods if is_learned(m)] + \
        [m for m in methods if is_reference(m)]
    handles, labels = ax1.get_legend_handles_labels()
    by = dict(zip(labels, handles))
    fig.legend([by[m] for m in order], order, loc="center right", fontsize=8, title="solid: training-free\ndashed: learned (LKV)\n"
               "dotted, hollow: per query head\n(cache repeated to q_heads)\nblack / grey: oracles / random", title_fontsize=7)
    fig.suptitle("kvevict fidelity on stories260K (%s %s excerpts, one-shot eviction after prefill)" % (prompts, text), fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(argv[2], dpi=110)
    print("wrote %s" % argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
