"""Write the results: OUT/grades.csv, OUT/<student>/feedback.md, OUT/<student>/results.json (Gradescope),
OUT/summary.png. Everything is sorted and free of timestamps, so a re-run writes identical files.

A class split over SLURM array tasks: ``mgpu-grade SUB --out OUT_K --shard K/N``, then ``mgpu-grade merge
OUT_1 ... OUT_N --out OUT`` (GRADING.md, "A SLURM cluster"). Students are ordered by a keyed hash and dealt
round-robin; merge copies each student's files as the shard wrote them and rebuilds grades.csv and summary.png.
"""

import csv
import hashlib
import hmac
import json
import shutil
import sys
from itertools import groupby
from operator import attrgetter
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


def feedback(student: str, rows: list[Row]) -> str:
    total, most = sum(r.points for r in rows), sum(r.max_points for r in rows)
    out = [f"# Feedback for {student}", "", f"**Total: {total} / {most} points**", "",
           "Only the code in your exercise cells is graded: it runs in a fresh copy of the course notebook, and "
           "each check also runs your function on inputs chosen by the grader.", ""]
    for nb, nrows in groupby(rows, key=attrgetter("notebook")):
        nrows = list(nrows)
        out += [f"## {nb}: {sum(r.points for r in nrows)} / {sum(r.max_points for r in nrows)}", ""]
        for title, passed in (("What passed:", True), ("What to fix:", False)):
            mine = [r for r in nrows if (r.status == "passed") == passed]
            if mine:
                out += [title, ""] + [f"- {_label(r)} ({r.points}/{r.max_points}{'' if passed else ', ' + r.status}): "
                                      + r.message.replace("\n", "\n  ") for r in mine] + [""]
    return "\n".join(out).rstrip() + "\n"


def gradescope(rows: list[Row], isolation: str) -> dict:
    """Gradescope's results.json; hidden checks' rows show once grades are published; ``output``: the isolation."""
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


def write_all(rows: list[Row], out: Path, isolation: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "grades.csv")
    for s, srows in groupby(sorted(rows, key=attrgetter("student")), key=attrgetter("student")):
        srows = list(srows)
        (out / s).mkdir(exist_ok=True)
        (out / s / "feedback.md").write_text(feedback(s, srows), encoding="utf-8")
        (out / s / "results.json").write_text(json.dumps(gradescope(srows, isolation), indent=2, ensure_ascii=False)
                                              + "\n", encoding="utf-8")
    if rows:
        summary_plot(rows, out / "summary.png")


MARKER = "shard.json"


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N) with 1 <= K <= N (SLURM's $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT, arrays from 1)."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"--shard {text}: K/N with 1 <= K <= N, e.g. --shard 3/8")
    return int(k), int(n)


def partition(students: list[str], key: bytes, n: int) -> list[list[str]]:
    """The class dealt into n slices: every student exactly once, the same slices for the same key and class."""
    order = sorted(students, key=lambda s: (hmac.new(key, b"shard\0" + s.encode(), hashlib.sha256).digest(), s))
    return [sorted(order[i::n]) for i in range(n)]


def write_marker(out: Path, k: int, n: int, students: list[str], key: bytes) -> None:
    slices = partition(students, key, n)
    # "key" names the key without revealing it: merge refuses shards graded with different keys
    tag = hmac.new(key, b"mgpu-grade shard tag", hashlib.sha256).hexdigest()[:16]
    (out / MARKER).write_text(json.dumps({"shard": k, "of": n, "key": tag, "students": slices[k - 1],
                                          "slices": slices}, indent=1) + "\n")


def merge(dirs: list[Path], out: Path) -> int:
    """Write the class's grades from the shards' output folders; 0, or 1 when a shard is missing."""
    markers, problems = {}, []
    for d in dirs:
        try:
            markers[d] = json.loads((d / MARKER).read_text())
        except (OSError, ValueError):
            problems.append(f"{d}: no {MARKER} (the shard did not finish)")
    if not markers:
        print("mgpu-grade merge: no finished shard among " + ", ".join(map(str, dirs)), file=sys.stderr)
        return 2
    first = next(iter(markers.values()))
    if any((m["of"], m["key"], m["slices"]) != (first["of"], first["key"], first["slices"]) for m in markers.values()):
        print("mgpu-grade merge: these shards come from different splits (another --shard N, key or class): "
              "re-run them with the same key on the same submissions", file=sys.stderr)
        return 2
    got = {m["shard"]: d for d, m in markers.items()}
    missing = [k for k in range(1, first["of"] + 1) if k not in got]
    for k in missing:
        names = first["slices"][k - 1]
        problems.append(f"shard {k}/{first['of']} missing: {len(names)} student(s) NOT graded: {', '.join(names)}")
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for k in sorted(got):
        d = got[k]
        with open(d / "grades.csv", newline="", encoding="utf-8") as f:
            rows += [Row(r["student"], r["notebook"], r["exercise"], int(r["points"]), int(r["max_points"]),
                         r["status"], r["message"], hidden=" hidden: " in r["exercise"]) for r in csv.DictReader(f)]
        for s in first["slices"][k - 1]:
            if (d / s).is_dir():
                shutil.copytree(d / s, out / s, dirs_exist_ok=True)
    rows.sort(key=attrgetter("student"))  # stable: each student's rows keep the order one run gives them
    write_csv(rows, out / "grades.csv")
    if rows:
        summary_plot(rows, out / "summary.png")
    (out / "MISSING.txt").unlink(missing_ok=True)
    if problems:
        (out / "MISSING.txt").write_text("\n".join(problems) + "\n")
        print("\n".join(f"mgpu-grade merge: {p}" for p in problems), file=sys.stderr)
    print(f"mgpu-grade merge: {len(got)}/{first['of']} shards, {len({r.student for r in rows})} students -> {out}"
          + (f"; {sum(len(first['slices'][k - 1]) for k in missing)} students missing (see MISSING.txt)"
             if missing else ""))
    return 1 if problems else 0
