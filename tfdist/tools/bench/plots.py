"""The plots of `tfdist bench`'s in-process suites (the comm suite draws its own): one PNG per
suite, `OUT/<suite>.png`, next to its table. Legends sit off the data, axes are labelled with
their units, paired bars stand side by side."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("tfdist bench draws its plots with matplotlib: "
                          "pip install 'tfdist[tools]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def engines(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.6))
    labels = [f"{r['engine']}\n({r['layout']})" for r in rows]
    ax.barh(labels, [r["step_ms"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["step_ms"], i, f" {r['step_ms']:.1f} ms", va="center", fontsize=8)
    ax.set(xlabel="step time (ms, median)", title="engines: step time per training step")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=8)
    ax.margins(x=0.2)
    return _save(fig, path)


def overhead(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6))
    ax.barh([r["label"] for r in rows], [r["step_ms"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["step_ms"], i, f" {r['step_ms']:.1f} ({r['overhead_ms']:+.1f})", va="center",
                fontsize=8)
    ax.set(xlabel="step time (ms, median); beyond Keras' in brackets",
           title="overhead: a world of one, no communication")
    ax.invert_yaxis()
    ax.margins(x=0.2)
    return _save(fig, path)


def compression(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8), sharey=True)
    labels = [r["compressor"] for r in rows]
    left.barh(labels, [r["ratio_vs_dense"] for r in rows], color="tab:orange")
    left.set(xscale="log", xlabel="bytes per step vs dense all-reduce (log scale)")
    right.barh(labels, [r["test_accuracy"] for r in rows], color="tab:green")
    low = min(r["test_accuracy"] for r in rows)
    right.set(xlim=(max(0.0, low - 0.05), 1.0), xlabel="test accuracy")
    left.invert_yaxis()
    fig.suptitle("compression: bytes and accuracy per compressor (same job)")
    return _save(fig, path)


def compressors(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.6))
    labels = [r["compressor"] + (f", {r['processes']} at once" if r.get("processes", 1) > 1
                                 else "") for r in rows]
    ax.barh(labels, [r["ms_per_mb"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["ms_per_mb"], i, f" {r['ms_per_mb']:.2f}", va="center", fontsize=8)
    ax.set(xlabel="ms per MB of gradient (median)", title="compressors: own work per MB")
    ax.invert_yaxis()
    ax.margins(x=0.15)
    return _save(fig, path)


def local_sgd(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for devices in sorted({r["devices"] for r in rows}):
        group = [r for r in rows if r["devices"] == devices]
        ax.scatter([r["rounds"] for r in group], [r["test_accuracy"] for r in group],
                   label=f"{devices} devices")
        for r in group:
            ax.annotate(r["run"], (r["rounds"], r["test_accuracy"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.set(xscale="log", xlabel="communication rounds (log scale)", ylabel="test accuracy",
           title="local SGD: accuracy against rounds")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    return _save(fig, path)


def memory(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    n = [r["replicas"] for r in rows]
    for key, label in (("baseline", "DistributedOptimizer (whole state)"),
                       ("zero1", "ZeRO stage 1"), ("zero2", "ZeRO stage 2"),
                       ("zero3", "ZeRO stage 3 (parameters included)")):
        if all(key in r for r in rows):
            ax.plot(n, [r[key] / 2**20 for r in rows], marker="o", label=label)
    ax.plot(n, [r["formula_zero2"] / 2**20 for r in rows], ls=":", color="grey",
            label="formula, stage 2: 4(K+2)⌈P/N⌉")
    ax.set(xscale="log", xticks=n, xlabel="replicas N", ylabel="MiB per replica",
           title="memory: optimizer state + parameter shard + gradient buffers")
    ax.set_xticklabels([str(v) for v in n])
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    return _save(fig, path)


def pipeline(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    runs = [r for r in rows if r["k"] > 1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for schedule in ("gpipe", "1f1b"):
        for k in sorted({r["k"] for r in runs}):
            group = [r for r in runs if r["schedule"] == schedule and r["k"] == k]
            if not group:
                continue
            label = f"{schedule}, K={k}"
            left.plot([r["m"] for r in group], [r["speedup"] for r in group], marker="o",
                      label=label)
            right.plot([r["m"] for r in group], [sum(r["idle"]) / k for r in group],
                       marker="o", label=f"{label}, measured")
            right.plot([r["m"] for r in group], [r["bubble"] for r in group], ls=":",
                       color="grey")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xlabel="micro-batches M", ylabel="throughput vs one device",
             title="pipeline: throughput")
    right.set(xlabel="micro-batches M", ylabel="mean idle fraction per stage",
              title="idle (dotted: the bubble (K-1)/(M+K-1))")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2,
                  frameon=False)
    return _save(fig, path)


def models(rows: list[dict], model: str, path: Path) -> Path:
    """One model's throughput per (algorithm, hosts, link), all workers together."""
    plt = pyplot()
    mine = [r for r in rows if r["model"] == model]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(mine) + 1.6))
    labels = [f"{r['label']}\n({r['hosts']} hosts @ {r['bandwidth']})" for r in mine]
    ax.barh(labels, [r["throughput"] for r in mine], color="tab:blue")
    for i, r in enumerate(mine):
        ax.text(r["throughput"], i, f" {r['throughput']:,.0f}", va="center", fontsize=8)
    ax.set(xlabel=f"{mine[0]['unit']} per second (all workers)", title=f"{model}: throughput")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.margins(x=0.2)
    return _save(fig, path)


def timeline(result: dict, path: Path, title: str = "one training step") -> Path:
    """A step's timeline (`tfdist.callbacks.StepTimeline`'s result): a lane per kind of op,
    a lane per collective, exposed communication shaded."""
    plt = pyplot()
    colours = {"forward": "tab:blue", "backward": "tab:orange", "update": "tab:green",
               "other": "tab:gray", "communication": "tab:red"}
    lanes = [(kind, result["intervals"][kind], colours[kind])
             for kind in ("forward", "backward", "update", "other")]
    lanes += [(f"{c['op']} {i + 1}", [[c["start_ms"], c["end_ms"]]], colours["communication"])
              for i, c in enumerate(result["collectives"])]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(lanes) + 1.8))
    for i, (_, spans, colour) in enumerate(lanes):
        ax.broken_barh([(s, e - s) for s, e in spans], (i - 0.35, 0.7), color=colour)
    ax.set_yticks(range(len(lanes)), [name for name, *_ in lanes], fontsize=7)
    ax.invert_yaxis()
    if result.get("backward_end_ms") is not None:
        ax.axvline(result["backward_end_ms"], color="black", linestyle="--", linewidth=0.8)
        ax.annotate(" backward pass ends", (result["backward_end_ms"], 1), xytext=(2, -4),
                    textcoords="offset points", fontsize=7, va="top",
                    xycoords=("data", "axes fraction"))
    ax.set_xlabel("ms from the step's first op")
    ax.set_title(f"{title}\n{result['span_ms']:.0f} ms; communication "
                 f"{result['communication_ms']:.0f} ms, of it exposed "
                 f"{result['exposed_communication_ms']:.0f} ms", fontsize=10)
    return _save(fig, path)


def input_suite(rows: list[dict], path: Path) -> Path:
    """The input suite: a resumed run's time to its first batch, record set against stream."""
    plt = pyplot()
    resume = [r for r in rows if r["kind"] == "resume"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    starts = [f"{r['start']:,}" for r in resume]
    at = list(range(len(resume)))
    ax.bar([a - 0.2 for a in at], [r["records_s"] for r in resume], 0.4, label="record set")
    ax.bar([a + 0.2 for a in at], [r["stream_s"] for r in resume], 0.4,
           label="TFRecord stream, skipped")
    ax.set_xticks(at, starts)
    ax.set_xlabel("resumed at global batch")
    ax.set_ylabel("time to the first batch (s)")
    ax.legend()
    return _save(fig, path)
