"""A class split over SLURM array tasks: ``mgpu-grade SUB --out OUT_K --shard K/N``, then ``mgpu-grade merge
OUT_1 ... OUT_N --out OUT`` (GRADING.md, "A SLURM cluster"). Students are ordered by a keyed hash and dealt
round-robin; merge copies each student's files as the shard wrote them and rebuilds grades.csv and summary.png.
"""
from __future__ import annotations

import csv
import hashlib
import hmac
import json
import shutil
import sys
from pathlib import Path

from .report import summary_plot, write_csv
from .score import Row

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


def read_rows(path: Path) -> list[Row]:
    with open(path, newline="", encoding="utf-8") as f:
        return [Row(r["student"], r["notebook"], r["exercise"], int(r["points"]), int(r["max_points"]), r["status"],
                    r["message"], hidden=" hidden: " in r["exercise"]) for r in csv.DictReader(f)]


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
        rows += read_rows(d / "grades.csv")
        for s in first["slices"][k - 1]:
            if (d / s).is_dir():
                shutil.copytree(d / s, out / s, dirs_exist_ok=True)
    order = {s: i for i, s in enumerate(sorted({r.student for r in rows}))}
    rows.sort(key=lambda r: order[r.student])  # stable: each student's rows keep the order one run gives them
    write_csv(rows, out / "grades.csv")
    if rows:
        summary_plot(rows, out / "summary.png")
    missing_txt = out / "MISSING.txt"
    if problems:
        missing_txt.write_text("\n".join(problems) + "\n")
        for p in problems:
            print(f"mgpu-grade merge: {p}", file=sys.stderr)
    elif missing_txt.exists():
        missing_txt.unlink()
    print(f"mgpu-grade merge: {len(got)}/{first['of']} shards, {len(order)} students -> {out}"
          + (f"; {sum(len(first['slices'][k - 1]) for k in missing)} students missing (see MISSING.txt)"
             if missing else ""))
    return 1 if problems else 0

