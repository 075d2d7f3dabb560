"""Write the results: OUT/grades.csv, OUT/<student>/feedback.md, OUT/<student>/results.json (Gradescope),
OUT/summary.png. Everything is sorted and free of timestamps, so a re-run writes identical files."""
from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from .score import Row

COLUMNS = ["student", "notebook", "exercise", "points", "max_points", "status", "message"]


def write_csv(rows: list[Row], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(COLUMNS)
        for r in rows:  # one line per row: the message's line breaks become spaces
            w.writerow([" ".join(r.message.split()) if c == "message" else getattr(r, c) for c in COLUMNS])


def _label(r: Row) -> str:
    if r.hidden:
        ex, name = r.exercise.split(" hidden: ", 1)
        return f"exercise {ex}, extra check “{name}”"
    return f"exercise {r.exercise}"


def _indent(msg: str) -> str:
    return msg.replace("\n", "\n  ")


def feedback(student: str, rows: list[Row]) -> str:
    total, most = sum(r.points for r in rows), sum(r.max_points for r in rows)
    out = [f"# Feedback for {student}", "", f"**Total: {total} / {most} points**", "",
           "Only the code in your exercise cells is graded: it runs in a fresh copy of the course notebook, and "
           "each check also runs your function on inputs chosen by the grader.", ""]
    by_nb: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_nb[r.notebook].append(r)
    for nb, nrows in by_nb.items():
        out += [f"## {nb}: {sum(r.points for r in nrows)} / {sum(r.max_points for r in nrows)}", ""]
        good = [r for r in nrows if r.status == "passed"]
        bad = [r for r in nrows if r.status != "passed"]
        if good:
            out += ["What passed:", ""] + [f"- {_label(r)} ({r.points}/{r.max_points}): {_indent(r.message)}"
                                           for r in good] + [""]
        if bad:
            out += ["What to fix:", ""] + [f"- {_label(r)} (0/{r.max_points}, {r.status}): {_indent(r.message)}"
                                           for r in bad] + [""]
    return "\n".join(out).rstrip() + "\n"


def gradescope(rows: list[Row], isolation: str = "") -> dict:
    """Gradescope's results.json: per test name, score, max_score, status, output and visibility (hidden
    checks' rows are shown once grades are published); the total score; ``output``: what isolated the run."""
    tests = [{"name": f"{r.notebook}: {_label(r)}", "score": r.points, "max_score": r.max_points,
              "status": "passed" if r.status == "passed" else "failed",
              "visibility": "after_published" if r.hidden else "visible",
              "output": f"[{r.status}] {r.message}"} for r in rows]
    return {"score": sum(r.points for r in rows), "output": isolation, "tests": tests}


def summary_plot(rows: list[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    students = sorted({r.student for r in rows})
    most = sum(r.max_points for r in rows if r.student == students[0]) if students else 0
    totals = [sum(r.points for r in rows if r.student == s) for s in students]
    checks = list(dict.fromkeys((r.notebook[:2], r.exercise) for r in rows))
    rate = [100 * sum(r.status == "passed" for r in rows if (r.notebook[:2], r.exercise) == c) / max(1, len(students))
            for c in checks]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    a.hist(totals, bins=range(0, most + 2), color="tab:blue", edgecolor="white", align="left")
    a.set(title=f"Total points ({len(students)} students)", xlabel=f"points (of {most})", ylabel="students")
    colors = ["tab:gray" if " hidden: " in ex else "tab:green" for _, ex in checks]
    b.bar(range(len(checks)), rate, color=colors)
    b.set_xticks(range(len(checks)), [ex if " hidden: " not in ex else ex.split(" hidden: ")[0] + " (hidden)"
                                      for _, ex in checks], rotation=60 if len(checks) > 8 else 0,
                  ha="right" if len(checks) > 8 else "center", fontsize=8)
    b.set(title="Students passing each check (grey: hidden checks)", ylabel="% of students", ylim=(0, 100))
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def write_all(rows: list[Row], out: Path, isolation: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "grades.csv")
    by_student: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_student[r.student].append(r)
    for s, srows in sorted(by_student.items()):
        d = out / s
        d.mkdir(exist_ok=True)
        (d / "feedback.md").write_text(feedback(s, srows), encoding="utf-8")
        (d / "results.json").write_text(json.dumps(gradescope(srows, isolation), indent=2, ensure_ascii=False) + "\n",
                                        encoding="utf-8")
    if rows:
        summary_plot(rows, out / "summary.png")
