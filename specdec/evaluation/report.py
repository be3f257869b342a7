"""Evaluation reports: report.json, report.md, acceptance.png and speedup.png from generation records.

report.json layout:

    {"tau_convention": ..., "command": ..., "versions": {...}, "settings": {...},
     "methods": {NAME: {"overall": GROUP, "categories": {CATEGORY: GROUP}}},
     "skipped": [{"id", "reason"}]}

skipped: prompts that did not fit a model's context (generation lines with a "skipped" reason);
they count for no method, so every method is measured on the same prompts.

GROUP: num_prompts, new_tokens, tau (= mean_accepted_tokens), acceptance_rate,
per_position_acceptance, tokens_per_second (median over prompts of per-prompt tokens/s),
speedup_vs_plain and speedup_vs_<baseline> for each baseline in the run (transformers' and llama.cpp's; ratios of
those medians, same prompts, same run), paired_vs_first (the geometric mean, over the prompts
both ran, of this method's tokens/s over the run's first method's on the same prompt: the
comparison to read between methods, as a median can fall on a different prompt for each
method), matches_plain (fraction of prompts whose output tokens
equal the plain method's) and stats (the merged AcceptanceStats dict). tau, acceptance_rate and
stats are null for transformers methods (no acceptance information); acceptance_rate is null
when nothing was drafted (plain decoding); comparisons are null when their reference is absent.
"""

from __future__ import annotations

import json
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path

from runtime.atomic import atomic_write, atomic_write_text
from specdec.methods import Method
from specdec.stats import AcceptanceStats

TAU_CONVENTION = ("tau = mean_accepted_tokens = tokens emitted per target forward pass, the bonus / "
                  "correction token included (plain decoding: tau = 1)")


def baseline_label(method: str) -> str | None:
    """The speedup_vs_<label> label of the method named `method` (`specdec.methods.BaselineSpec.label`;
    None for plain and the drafters)."""
    return Method.parse(method).label


def _group(records: dict[str, dict[str, dict]], ids: list[str], method: str, first: str) -> dict:
    """Metrics of `method` over prompt ids `ids`; records[method][prompt_id] = generation line;
    `first`: the method paired_vs_first compares against."""
    mine = [records[method][i] for i in ids if i in records[method]]
    tps = statistics.median(r["tokens_per_second"] for r in mine) if mine else None
    stats = None
    for r in mine:
        if r["stats"] is not None:
            s = AcceptanceStats.from_dict(r["stats"])
            stats = s if stats is None else stats.merge(s)
    group = {"num_prompts": len(mine), "new_tokens": sum(r["new_tokens"] for r in mine),
             "tau": stats.mean_accepted_tokens if stats else None,
             "acceptance_rate": stats.acceptance_rate if stats and stats.drafted_tokens else None,
             "per_position_acceptance": stats.per_position_acceptance if stats else None,
             "tokens_per_second": tps}
    refs = [("plain", "plain")] + [(m, baseline_label(m)) for m in records if baseline_label(m)]
    for ref, label in refs:
        ref_tps = _median_tps(records.get(ref, {}), ids)
        group[f"speedup_vs_{label}"] = tps / ref_tps if tps and ref_tps else None
    group["paired_vs_first"] = _paired_ratio(records[method], records.get(first, {}), ids)
    if "plain" in records:
        plain = records["plain"]
        pairs = [(r, plain[r["id"]]) for r in mine if r["id"] in plain]
        group["matches_plain"] = (sum(r["output_ids"] == p["output_ids"] for r, p in pairs) / len(pairs)
                                  if pairs else None)
    else:
        group["matches_plain"] = None
    group["stats"] = stats.to_dict() if stats else None
    return group


def _paired_ratio(mine: dict[str, dict], ref: dict[str, dict], ids: list[str]) -> float | None:
    """Geometric mean of per-prompt tokens/s ratios mine / ref over the prompts both ran."""
    logs = [math.log(mine[i]["tokens_per_second"] / ref[i]["tokens_per_second"]) for i in ids
            if i in mine and i in ref and mine[i]["tokens_per_second"] > 0 and ref[i]["tokens_per_second"] > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _median_tps(by_id: dict[str, dict], ids: list[str]) -> float | None:
    vals = [by_id[i]["tokens_per_second"] for i in ids if i in by_id]
    return statistics.median(vals) if vals else None


def build_report(records: list[dict], settings: dict, methods: list[str], prompt_ids: list[str],
                 command: str, versions: dict) -> dict:
    """report.json content from generation lines (only `methods` x `prompt_ids` are used)."""
    wanted = set(prompt_ids)
    reasons: dict[str, str] = {}
    for r in records:
        if r.get("skipped") and r["id"] in wanted:
            reasons.setdefault(r["id"], r["skipped"])
    skipped = [{"id": i, "reason": reasons[i]} for i in prompt_ids if i in reasons]
    by_method: dict[str, dict[str, dict]] = {m: {} for m in methods}
    category: dict[str, str] = {}
    for r in records:
        if r["method"] in by_method and r["id"] in wanted and r["id"] not in reasons:
            by_method[r["method"]][r["id"]] = r
            category[r["id"]] = r["category"]
    ordered = [i for i in prompt_ids if i in category]
    cats = sorted(set(category.values()))
    out_methods = {}
    for m in methods:
        out_methods[m] = {"overall": _group(by_method, ordered, m, methods[0]),
                          "categories": {c: _group(by_method, [i for i in ordered if category[i] == c], m,
                                                   methods[0])
                                         for c in cats}}
    return {"tau_convention": TAU_CONVENTION, "command": command, "versions": versions,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings": {**settings, "k": settings.get("num_draft_tokens"), "methods": methods,
                         "num_prompts": len(ordered)},
            "methods": out_methods, "skipped": skipped}


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _table(report: dict, section: str, category: str | None) -> list[str]:
    methods = report["methods"]
    any_group = next(iter(methods.values()))["overall"]
    vs = [k for k in any_group if k.startswith("speedup_vs_")]
    head = ["method", "prompts", "tau", "acceptance", "tok/s (median)", *[k.replace("speedup_", "speedup ")
                                                                         .replace("_", " ") for k in vs],
            f"vs `{next(iter(methods))}` (paired)", "matches plain"]
    lines = [f"| {' | '.join(head)} |", f"|{'|'.join(['---'] + ['---:'] * (len(head) - 1))}|"]
    for name, m in methods.items():
        g = m["overall"] if category is None else m["categories"].get(category)
        if g is None:
            continue
        cells = [f"`{name}`", _fmt(g["num_prompts"]), _fmt(g["tau"]), _fmt(g["acceptance_rate"]),
                 _fmt(g["tokens_per_second"], 1), *[_fmt(g[k]) + ("x" if g[k] is not None else "") for k in vs],
                 _fmt(g["paired_vs_first"]) + ("x" if g["paired_vs_first"] is not None else ""),
                 _fmt(g["matches_plain"])]
        lines.append(f"| {' | '.join(cells)} |")
    return [f"### {section}", "", *lines, ""]


def render_markdown(report: dict) -> str:
    """report.md: settings, the overall table, then one table per category."""
    s = report["settings"]
    source = s.get("dataset") or s.get("prompts")
    lines = ["## specdec eval", "",
             f"Target `{s['target']}`, {s['dtype']} on {s['device']}, prompts: {source} "
             f"({s['num_prompts']}, {s['prompt_format']}), max_new_tokens {s['max_new_tokens']}, "
             f"k = {s['k']} (a method's `@K` suffix overrides it), temperature {s['temperature']}, "
             f"row-invariant kernels {'on' if s.get('row_invariant') else 'off'}.", "",
             f"Command: `{report['command']}`", "",
             f"Convention: {report['tau_convention']}. tok/s = median over prompts of new tokens / wall "
             "seconds of the whole call (prefill included); speedups are ratios of those medians "
             "measured in this run; paired = geometric mean over prompts of the per-prompt tok/s "
             "ratio to the first method (the comparison between methods); matches plain = fraction "
             "of prompts whose output tokens equal plain decoding's.", ""]
    skipped = report.get("skipped") or []
    if skipped:
        lines += [f"Skipped {len(skipped)} prompt{'s' if len(skipped) > 1 else ''} that did not fit the context "
                  "(not scored for any method): " + "; ".join(f"`{s['id']}` ({s['reason']})" for s in skipped) + ".",
                  ""]
    lines += _table(report, "Overall", None)
    cats = sorted({c for m in report["methods"].values() for c in m["categories"]})
    if len(cats) > 1:
        for c in cats:
            lines += _table(report, f"Category: {c}", c)
    v = report["versions"]
    lines += [f"torch {v.get('torch')}, transformers {v.get('transformers')}, specdec {v.get('specdec')}, "
              f"python {v.get('python')}, {v.get('platform')}, {v.get('cpu_count')} CPUs.", ""]
    return "\n".join(lines)


def _save_figure(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: only to draw, not at CLI start

    FigureCanvasAgg(fig)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))


def plot_acceptance(report: dict, path: Path) -> None:
    """Per-position acceptance P(draft i accepted | drafts < i accepted), one line per method."""
    from matplotlib.figure import Figure  # matplotlib: only to draw, not at CLI start
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    drawn = 0
    for name, m in report["methods"].items():
        ppa = m["overall"]["per_position_acceptance"]
        if ppa:
            ax.plot(range(1, len(ppa) + 1), ppa, marker="o", label=name)
            drawn += 1
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no method drafted tokens", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("P(accept i | all before accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Per-position acceptance ({report['settings']['target']})")
    _save_figure(fig, path)


def plot_speedup(report: dict, path: Path) -> None:
    """Bars of speedup vs plain (and vs each transformers baseline present) per method."""
    from matplotlib.figure import Figure  # matplotlib: only to draw, not at CLI start

    methods = list(report["methods"])
    refs = [k for k in report["methods"][methods[0]]["overall"] if k.startswith("speedup_vs_")]
    refs = [k for k in refs if any(report["methods"][m]["overall"][k] is not None for m in methods)]
    fig = Figure(figsize=(max(6, 1.2 * len(methods)), 4))
    ax = fig.add_subplot()
    width = 0.8 / max(len(refs), 1)
    for j, ref in enumerate(refs):
        vals = [report["methods"][m]["overall"][ref] or 0.0 for m in methods]
        ax.bar([i + j * width for i in range(len(methods))], vals, width, label=ref.replace("speedup_", ""))
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([i + width * (len(refs) - 1) / 2 for i in range(len(methods))])
    ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup (median tokens/s ratio)")
    if refs:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no plain or transformers baseline in this run", ha="center", va="center",
                transform=ax.transAxes)
    _save_figure(fig, path)


def write_report(out: str | Path, report: dict) -> None:
    """Write report.json, report.md, acceptance.png and speedup.png into `out` (atomically)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"),
                       ("report.md", render_markdown(report))):
        atomic_write_text(out / name, text)
    plot_acceptance(report, out / "acceptance.png")
    plot_speedup(report, out / "speedup.png")
