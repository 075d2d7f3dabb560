"""Build the notebook the grader executes, never trusting the submitted file.

Only the source of the learner's *exercise cells* is taken (by the id in ``metadata.mgpu.exercise``, without
``# NBVAL_*`` lines), spliced into a pristine copy of the solution notebook: every other cell, tag and expected
output is the instructor's. The grader's *prime* and *harvest* cells (judge.py) go around each check cell.
An exercise missing or duplicated in the submission, or "stubbed" (it took the kernel down in an earlier
run), gets the release's stub instead.
"""

import copy
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ..authoring import course_notebooks, mgpu, release_notebook, validate

MAX_SUBMISSION_BYTES = 32 * 2**20  # a notebook with a few plots is < 5 MB; anything bigger is refused


@dataclass
class ExerciseSpec:
    id: str
    function: str
    points: int          # the check cell's points
    stub: str            # the release's source of the exercise cell


@dataclass
class CourseNotebook:
    name: str            # "01_where_memory_goes.ipynb"
    nb: nbformat.NotebookNode
    module: str          # metadata mgpu.module: the helper module whose import registers the checks
    exercises: list[ExerciseSpec]


def load_course(solutions: Path) -> list[CourseNotebook]:
    """The solution notebooks, validated against the schema (a broken course is the instructor's error)."""
    course, problems = [], []
    for p in course_notebooks(solutions):
        nb = nbformat.read(str(p), as_version=4)
        problems += validate(nb, p.name)
        checks = {mgpu(c)["check"]: c for c in nb.cells if "check" in mgpu(c)}
        stubs = {mgpu(c)["exercise"]: c.source for c in release_notebook(nb).cells if "exercise" in mgpu(c)}
        exercises = [ExerciseSpec(m["exercise"], m["function"], int(mgpu(checks[m["exercise"]]).get("points", 1)),
                                  stubs[m["exercise"]])
                     for c in nb.cells if "exercise" in (m := mgpu(c)) and m["exercise"] in checks]
        course.append(CourseNotebook(p.name, nb, nb.metadata.get("mgpu", {}).get("module", ""), exercises))
    if problems:
        raise ValueError("the solution notebooks do not follow the schema:\n  " + "\n  ".join(problems))
    return course


def clean_source(source: str) -> str:
    """The learner's code without nbval markers (``# NBVAL_SKIP`` & co. would change how nbval runs it)."""
    keep = [line for line in source.splitlines()
            if not (line.lstrip().startswith("#") and ("NBVAL_" in line.upper() or "PYTEST_VALIDATE" in line.upper()))]
    return "\n".join(keep)


@dataclass
class Submission:
    status: str = "ok"   # ok | missing-notebook | invalid-notebook
    message: str = ""
    sources: dict[str, str] = field(default_factory=dict)              # exercise id -> cleaned source
    problems: dict[str, tuple[str, str]] = field(default_factory=dict)  # exercise id -> (status, message)


def read_submission(path: Path, course: CourseNotebook) -> Submission:
    """Parse and validate one submitted notebook and take its exercise cells by id."""
    if not path.is_file():
        return Submission("missing-notebook", f"{course.name} was not submitted")
    if path.stat().st_size > MAX_SUBMISSION_BYTES:
        return Submission("invalid-notebook", f"{course.name} is larger than {MAX_SUBMISSION_BYTES >> 20} MiB")
    try:
        text = path.read_bytes().decode("utf-8")
        json.loads(text)
    except UnicodeDecodeError:
        return Submission("invalid-notebook", f"{course.name} is not UTF-8 text")
    except ValueError as e:
        return Submission("invalid-notebook", f"{course.name} is not valid JSON ({e.msg} at line {e.lineno}, "
                                              f"column {e.colno}); was it edited by hand or truncated?")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # duplicate cell ids are repaired by nbformat; the grader ignores them
            nb = nbformat.reads(text, as_version=4)
            nbformat.validate(nb)
    except Exception as e:  # noqa: BLE001 - any failure to parse is the file's
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return Submission("invalid-notebook", f"{course.name} is not a valid Jupyter notebook ({first})")
    found: dict[str, list[str]] = {}
    for c in nb.cells:
        ex = mgpu(c).get("exercise") if isinstance(mgpu(c), dict) else None
        if c.cell_type == "code" and isinstance(ex, str):
            found.setdefault(ex, []).append(c.source)  # nbformat.reads joins a list of lines
    sub = Submission()
    for spec in course.exercises:
        cells = found.get(spec.id, [])
        if not cells:
            sub.problems[spec.id] = ("missing-exercise", f"no exercise cell with id {spec.id} in {course.name} "
                                     "(was the cell deleted or its metadata changed?)")
        elif len(cells) > 1:
            sub.problems[spec.id] = ("duplicate-exercise", f"{len(cells)} cells claim exercise {spec.id} in "
                                     f"{course.name}; keep exactly one")
        else:
            sub.sources[spec.id] = clean_source(cells[0])
    return sub


@dataclass
class Layout:
    """nbval's code-cell numbers ("Cell N") of each exercise's cells in the assembled notebook."""
    exercise: dict[str, int]
    check: dict[str, int]
    harvest: dict[str, int]
    n_code: int

    def span_end(self, ex: str) -> int:
        return max(self.check[ex], self.harvest[ex])


def _grader_cell(ex: str, work: str, step: str):
    # __import__ keeps the learner's namespace free of grader names.
    args = f"{ex!r}, globals(), {work!r}" if step == "harvest" else f"{ex!r}, {work!r}"
    source = ("# Added by mgpu-grade: runs your function on the grader's inputs; the verdict is decided outside.\n"
              f"__import__('mgpu_helpers.tools.grading.judge', fromlist=['{step}']).{step}({args})")
    return nbformat.v4.new_code_cell(source, id=f"mgpu-grade-{step}-{ex.replace('.', '-')}",
                                     metadata={"mgpu_grade": {step: ex}})


def assemble(course: CourseNotebook, sources: dict[str, str], stubbed: set[str], work: str):
    """(notebook, layout): the solution notebook with the learner's exercise sources and harvest cells, up to
    the last harvest."""
    nb = copy.deepcopy(course.nb)
    ids = {e.id: e for e in course.exercises}
    last: dict[str, int] = {}  # the harvest goes after the later of an exercise's exercise and check cells
    for i, c in enumerate(nb.cells):
        m = mgpu(c)
        for key in ("exercise", "check"):
            if c.cell_type == "code" and m.get(key) in ids:
                last[m[key]] = i
    cells = []
    for i, c in enumerate(nb.cells):
        m = mgpu(c)
        if c.cell_type == "code" and m.get("exercise") in ids:
            ex = m["exercise"]
            c.source = sources[ex] if ex in sources and ex not in stubbed else ids[ex].stub
        if c.cell_type == "code" and m.get("check") in ids:
            cells.append(_grader_cell(m["check"], work, "prime"))
        cells.append(c)
        for ex in [e for e, j in last.items() if j == i]:
            cells.append(_grader_cell(ex, work, "harvest"))
    # Nothing after the last harvest decides a grade: the run stops there.
    harvests = [i for i, c in enumerate(cells) if "harvest" in c.metadata.get("mgpu_grade", {})]
    nb.cells = cells[:harvests[-1] + 1] if harvests else cells
    code = [{**mgpu(c), **c.metadata.get("mgpu_grade", {})} for c in cells if c.cell_type == "code"]
    roles = ({m[key]: n for n, m in enumerate(code) if m.get(key) in ids} for key in ("exercise", "check", "harvest"))
    return nb, Layout(*roles, len(code))
