"""Results folder for a sweep: results.json (every figure), summary.md (table + ratios), PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

RATIO_FIELDS = (("output_tok_per_s", None, "out tok/s"), ("req_per_s", None, "req/s"),
                ("ttft_ms", "p50", "TTFT p50"), ("ttft_ms", "p99", "TTFT p99"),
                ("itl_ms", "p50", "ITL p50"), ("itl_ms", "p99", "ITL p99"), ("e2e_ms", "p50", "E2E p50"))


def _value(row: dict[str, Any], key: str, sub: str | None) -> float | None:
    v = row.get(key)
    return v.get(sub) if sub and isinstance(v, dict) else v


def ratios(results: list[dict[str, Any]], numerator: str, denominator: str) -> list[dict[str, Any]]:
    """numerator/denominator per concurrency for each RATIO_FIELDS figure (None where either is missing)."""
    by = {(r["target"], r["concurrency"]): r for r in results}
    out = []
    for (target, c), num in sorted(by.items(), key=lambda kv: kv[0][1]):
        den = by.get((denominator, c))
        if target != numerator or den is None:
            continue
        row: dict[str, Any] = {"concurrency": c, "of": f"{numerator}/{denominator}"}
        for key, sub, label in RATIO_FIELDS:
            a, b = _value(num, key, sub), _value(den, key, sub)
            row[label] = (a / b) if a is not None and b else None
        out.append(row)
    return out


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: `columns` are (title, alignment: "l" or "r"), each row its cells already formatted."""
    head = "| " + " | ".join(title for title, _ in columns) + " |"
    rule = "|" + "|".join("---" if align == "l" else "--:" for _, align in columns) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(row) + " |" for row in rows)])


def results_table(results: list[dict[str, Any]]) -> str:
    columns = [("target", "l"), *((title, "r") for title in (
        "conc", "requests", "errors", "out tok/s", "req/s", "TTFT p50 / p90 / p99 (ms)", "ITL p50 / p90 / p99 (ms)",
        "E2E p50 / p90 / p99 (ms)", "tokens/req"))]
    return markdown_table(columns, (
        [r["target"], str(r["concurrency"]), str(r["requests"]), str(r["errors"]), _f(r["output_tok_per_s"]),
         _f(r["req_per_s"], 2), " / ".join(_f(r["ttft_ms"][p], 0) for p in ("p50", "p90", "p99")),
         " / ".join(_f(r["itl_ms"][p]) for p in ("p50", "p90", "p99")),
         " / ".join(_f(r["e2e_ms"][p], 0) for p in ("p50", "p90", "p99")), _f(r["output_tokens_per_request"])]
        for r in results))


def ratio_table(rows: list[dict[str, Any]]) -> str:
    labels = [label for _, _, label in RATIO_FIELDS]
    return markdown_table([("ratio", "l"), ("conc", "r"), *((label, "r") for label in labels)],
                          ([row["of"], str(row["concurrency"]), *(_f(row[label], 2) for label in labels)]
                           for row in rows))


def plot(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in results))
    series = {t: sorted((r for r in results if r["target"] == t), key=lambda r: r["concurrency"]) for t in targets}
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t, rows in series.items():
        cs = [r["concurrency"] for r in rows]
        axes[0].plot(cs, [r["output_tok_per_s"] or 0 for r in rows], marker="o", label=t)
        axes[1].plot(cs, [r["req_per_s"] or 0 for r in rows], marker="o", label=t)
    for ax, title in zip(axes, ("output tokens/s", "requests/s")):
        ax.set(xscale="log", xlabel="concurrency", title=title)
        ax.set_xticks(sorted({r["concurrency"] for r in results}), labels=[str(c) for c in sorted({r["concurrency"] for r in results})])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for key, title, name in (("ttft_ms", "time to first token (ms)", "ttft.png"),
                             ("itl_ms", "inter-token latency (ms)", "itl.png")):
        fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
        for ax, p in zip(axes, ("p50", "p90", "p99")):
            for t, rows in series.items():
                ax.plot([r["concurrency"] for r in rows], [r[key][p] or float("nan") for r in rows],
                        marker="o", label=t)
            ax.set(xscale="log", yscale="log", xlabel="concurrency", title=f"{title}, {p}")
            ax.set_xticks(sorted({r["concurrency"] for r in results}),
                          labels=[str(c) for c in sorted({r["concurrency"] for r in results})])
            ax.grid(alpha=0.3, which="both")
            ax.legend()
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_results(out_dir: Path, meta: dict[str, Any], results: list[dict[str, Any]],
                  ratio_pairs: list[tuple[str, str]], plots: bool = True,
                  sections: list[str] | None = None) -> dict[str, Path]:
    """`sections`: more Markdown (tables, images already in out_dir) for summary.md, after the main table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    present = {r["target"] for r in results}
    all_ratios = [row for num, den in ratio_pairs if num in present and den in present
                  for row in ratios(results, num, den)]
    (out_dir / "results.json").write_text(json.dumps({**meta, "results": results, "ratios": all_ratios},
                                                     indent=2) + "\n")
    workload = meta.get("workload", {})
    md = [f"# {meta.get('title', 'Benchmark')}", "",
          f"{meta.get('date', '')}; {meta.get('machine', '')}; wall time {meta.get('wall_s', 0):.0f} s.", "",
          f"Workload `{workload.get('name')}`: {workload.get('num_prompts')} prompts of "
          f"{workload.get('input_tokens')} tokens (+ chat template), exactly {workload.get('output_tokens')} "
          f"output tokens per request, seed {workload.get('seed')}, closed loop, greedy.", "",
          results_table(results), ""]
    for section in sections or ():
        md += [section, ""]
    if all_ratios:
        md += ["Ratios per concurrency (numerator/denominator; for throughput > 1 means the numerator is faster, "
               "for latencies > 1 means it is slower):", "", ratio_table(all_ratios), ""]
    notes = meta.get("notes")
    if notes:
        md += [*notes, ""]
    paths = {"json": out_dir / "results.json", "md": out_dir / "summary.md"}
    if plots and results:
        for p in plot(results, out_dir):
            paths[p.stem] = p
        md += ["![throughput](throughput.png)", "", "![TTFT](ttft.png)", "", "![ITL](itl.png)", ""]
    paths["md"].write_text("\n".join(md))
    return paths
