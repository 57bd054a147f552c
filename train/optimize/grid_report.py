"""What ``optimize-grid`` reports: grid.json's dict from what its stages measured (:func:`grid_json`), the search's
result against the grid's best (:func:`optimized_vs_best`) and grid.md (:func:`render`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from train.optimize.grid_final import Final
from train.optimize.grid_screen import Judged, Screening
from train.optimize.grid_space import LEFT_OUT
from train.optimize.outputs import format_loss as _loss
from train.optimize.outputs import format_ratio as _ratio
from train.optimize.settings import SearchSettings
from train.perf.ab import ArmResult


def grid_json(named: dict[str, dict[str, Any]], sc: Screening, judged: Judged, fin: Final, o: Any,
              s: SearchSettings, seconds: float, optimized: Optional[str], facts: dict[str, Any]) -> dict[str, Any]:
    """grid.json's dict: the best and its rate, the screening's rows (with their quality verdicts), the final's, the
    search's result against the best (``optimized``: its config's path, with ``--optimized``); ``facts``: the
    ``device``, ``machine``, ``torch`` version and ``config`` path."""
    finalists, best, metric = fin.finalists, fin.best, sc.rates.metric
    medians = {n: sc.rates.of(fin.pairs[n], n) for n in finalists}
    first = fin.pairs[finalists[0]]
    if optimized is None:
        vs = {n: first.ratio(n, best, metric).as_dict() if n != best else None for n in finalists}
    else:
        vs = {n: fin.pairs[n].ratio(n, "optimized", metric).as_dict() for n in finalists}
        pooled = ArmResult("optimized", [w for n in finalists for w in fin.pairs[n].arms["optimized"].windows])
        m = pooled.median(metric)  # over every pair's windows of the search's result
        medians["optimized"] = None if m is None else m / sc.rates.per_sample
    guard, quality = judged.guard, sc.quality
    rows = [{"name": n, "settings": named[n], "samples_per_s": sc.medians[n],
             "vs_best": sc.result.ratio(n, best, metric).as_dict() if n != best else None, "quality": quality[n],
             "quality_guard": guard[n]} for n in sc.ranked + ["baseline"]]
    final_rows = [{"name": n, "samples_per_s": medians[n], "vs_best": vs[n] if optimized is None else None,
                   "vs_optimized": vs[n] if optimized is not None else None}
                  for n in sorted(finalists, key=lambda n: -(medians[n] or 0))]
    return {
        "best": best, "best_samples_per_s": medians[best], "points": len(sc.ranked), "seconds": seconds,
        "fastest_of_the_screening": sc.ranked[0], "quality_reference": {"settings": named["baseline"],
                                                                        **quality["baseline"]},
        "quality_tolerance": o.quality_tolerance, "quality_samples_seen": s.quality_samples_seen(),
        "rejected_by_quality_guard": [n for n in sc.ranked if guard[n]["passes"] is False],
        "quality_horizon_samples": s.horizon_samples, "judged_at_the_horizon": judged.late,
        "screening": {"rounds": o.grid_rounds, "seconds": sc.seconds, "rows": rows,
                      "load_1min": [sc.result.load_start, sc.result.load_end]},
        "guard_seconds": judged.seconds,
        "final": {"rounds": o.confirm_rounds, "seconds": seconds - sc.seconds - judged.seconds, "rows": final_rows,
                  "paired_with_optimized": optimized is not None, "load_1min": [first.load_start, first.load_end],
                  "process": "fresh: one new process per A/B (isolated.py)", "failed": fin.failed},
        "window_samples": o.window_samples, "metric": metric, "real_tokens_per_sample": sc.rates.per_sample,
        "left_out": LEFT_OUT,
        "device": facts["device"], "load_1min": [sc.result.load_start, first.load_end],
        "machine": facts["machine"], "torch": facts["torch"], "config": facts["config"],
        "optimized": None if optimized is None else {
            **optimized_vs_best(optimized, named["optimized"], fin.pairs[best], best, medians["optimized"], seconds,
                                metric=metric, recheck=fin.recheck, recheck_failed=fin.recheck_failed),
            "quality": quality["optimized"], "quality_guard": guard["optimized"]},
    }


def optimized_vs_best(path: str, settings: dict[str, Any], selection: Any, best: str,
                      samples_per_s: Optional[float], grid_s: float, share: float = 0.95, metric: str = "samples",
                      recheck: Optional[Any] = None, recheck_failed: Optional[str] = None) -> dict[str, Any]:
    """The search's result against the grid's best: the ratio with its interval, whether it reaches ``share`` of the
    best (``reached``: the interval's lower bound ≥ share; ``not shown``: only the median; ``not reached``: the median
    below), and the search's time (its optimize.json) as a share of the grid's.

    ``selection``: the final's A/B the best was picked on (the largest of several noisy ratios, so biased in the
    best's favour: the winner's curse); ``recheck``: one more A/B of the same two, measured after the pick, on
    windows the pick never saw — the verdict is taken on it when it exists (Cawley & Talbot, JMLR 2010, on the bias
    of a selection's own score); ``recheck_failed``: why it does not."""
    picked = selection.ratio("optimized", best, metric)
    r = recheck.ratio("optimized", best, metric) if recheck is not None else picked
    verdict = ("not measured" if r.median is None else "reached" if r.clears(share)
               else "not shown" if r.median >= share else "not reached")
    search_s: Optional[float] = None
    why: Optional[str] = None
    report = Path(path).with_name("optimize.json")
    try:
        search_s = float(json.loads(report.read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{report}: {type(e).__name__}"
    return {"config": path, "settings": settings, "samples_per_s": samples_per_s, "vs_best": r.as_dict(),
            "vs_best_source": "recheck" if recheck is not None else "selection",
            "vs_best_at_selection": picked.as_dict(), "recheck_failed": recheck_failed,
            "target_share": share, "share_verdict": verdict, "search_seconds": search_s,
            "search_seconds_unavailable_reason": why,
            "search_share_of_grid_time": None if search_s is None else search_s / grid_s}


def render(g: dict[str, Any]) -> str:
    lines = [f"# optimize-grid: {g['points']} combinations in {g['seconds']:.0f} s ({g['device']}, load "
             f"{g['load_1min']})", "", f"Best: **{g['best']}** at {g['best_samples_per_s']:.1f} samples/s.", ""]
    opt = g["optimized"]
    if opt:
        r = opt["vs_best"]
        share = opt["search_share_of_grid_time"]
        where = ("in one more fresh A/B after the pick (at the pick: "
                 f"{_ratio(opt['vs_best_at_selection'])})" if opt.get("vs_best_source") == "recheck" else
                 "in the A/B it was picked on (biased in the best's favour"
                 + (f"; the re-check failed: {opt['recheck_failed']})" if opt.get("recheck_failed") else ")"))
        lines += [f"`make optimize`'s result ({opt['config']}): {_sps(opt['samples_per_s'])} samples/s = {_ratio(r)} "
                  f"of the grid's best {where} ({r['verdict']}); >= {opt['target_share']:.0%} of the "
                  f"best: **{opt['share_verdict']}**. The search took "
                  + (f"{opt['search_seconds']:.0f} s = {share:.0%} of this grid's {g['seconds']:.0f} s."
                     if share is not None else f"an unknown time ({opt['search_seconds_unavailable_reason']})."), ""]
    ref = g["quality_reference"]
    late = g.get("judged_at_the_horizon") or []
    lines += [f"Quality guard (as `make optimize`'s), in the screening's order until {len(g['final']['rows'])} "
              f"finalists learn as well: the held-out loss after {g.get('quality_samples_seen')} samples, against "
              f"the config as given (`baseline`, {_loss(ref.get('loss'))}) or the combination it grows from (a token "
              f"budget: the same at the config's batch size; packed rows: the same in fitted buckets); other steps "
              f"per sample are judged after {g.get('quality_horizon_samples')} samples instead ({len(late)} arm(s) "
              f"trained on to there, {g.get('guard_seconds') or 0:.0f} s); + {100 * g['quality_tolerance']:g}%; "
              f"{len(g['rejected_by_quality_guard'])} combination(s) learn worse and are not finalists"
              + (f" (the screening's fastest, {g['fastest_of_the_screening']}, among them)"
                 if g["fastest_of_the_screening"] in g["rejected_by_quality_guard"] else "") + ".", ""]
    st = g["final"]
    if st.get("paired_with_optimized"):
        lines += [f"## Final: the search's result against each of {len(st['rows'])} finalists, two arms interleaved "
                  f"({st['rounds']} rounds each, the search's own A/B), {st['seconds']:.0f} s", "",
                  "| combination | samples/s | it vs optimized [95% interval] |", "|---|---|---|"]
        lines += [f"| {row['name']} | {_sps(row['samples_per_s'])} | {_ratio(row['vs_optimized'])} |"
                  for row in st["rows"]]
    else:
        lines += [f"## Final: {len(st['rows'])} combinations, {st['rounds']} interleaved rounds, {st['seconds']:.0f} s",
                  "", "| combination | samples/s | vs best [95% interval] |", "|---|---|---|"]
        lines += [f"| {row['name']} | {_sps(row['samples_per_s'])} | "
                  + ("best" if row["vs_best"] is None else _ratio(row["vs_best"])) + " |" for row in st["rows"]]
    lines += [f"- {n}: not measured ({why})" for n, why in st.get("failed", {}).items()]
    lines += ["", "Each A/B of the final ran in a new process (the screening's holds a hundred arms' heap)."]
    st = g["screening"]
    lines += ["", f"## Screening: {len(st['rows'])} combinations, {st['rounds']} interleaved rounds, "
                  f"{st['seconds']:.0f} s", "",
              "| combination | samples/s | vs the best [95% interval] | held-out loss | quality guard |",
              "|---|---|---|---|---|"]
    lines += [f"| {row['name']} | {_sps(row['samples_per_s'])} | "
              + ("best" if row["vs_best"] is None else _ratio(row["vs_best"]))
              + f" | {_loss(row['quality'].get('loss'))} | "
              + {True: "passes", None: "not judged"}.get(row["quality_guard"]["passes"],
                                                          f"**fails**: {row['quality_guard']['why']}") + " |"
              for row in st["rows"]]
    lines.append("")
    lines += ["", "Left out of the grid: " + "; ".join(f"{k} ({v})" for k, v in g["left_out"].items()), ""]
    return "\n".join(lines)


def _sps(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.1f}"
