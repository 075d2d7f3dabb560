"""Did the learner's answer use the course's own code? (``course_code_used``) It would fail anyway (the package holds
no answers); this names the reason instead of a confusing difference. Static: it follows what the learner's function
or class names (the notebook's own helpers too) and reports the first course object outside ``Check.may_use``."""

import functools
import inspect
import itertools
import types

from ..runtime.exercises import code_objects  # a function's code objects, nested ones too

PACKAGE = __name__.split(".")[0]        # mgpu_helpers


def _course_module(name: str | None, may_use) -> str | None:
    within = lambda package: bool(name) and (name == package or name.startswith(package + "."))  # noqa: E731
    return name if within(PACKAGE) and not any(map(within, may_use)) else None


def _name_of(value, may_use) -> str | None:
    """'mgpu_helpers.accumulation.accumulate' when ``value`` is a course module, function, class or method."""
    if isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, (types.MethodType, staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, types.ModuleType):
        return _course_module(value.__name__, may_use)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        module = _course_module(getattr(value, "__module__", None), may_use)
        return module and f"{module}.{getattr(value, '__qualname__', getattr(value, '__name__', '?'))}"
    return None


def course_code_used(obj, may_use=(), _seen=None) -> str | None:
    """The dotted name of the first course object ``obj`` (a learner's function or class) uses, else None."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    direct = _name_of(obj, may_use)
    if direct:
        return direct
    module = getattr(obj, "__module__", None) or ""
    if module.startswith(PACKAGE + ".") and not _course_module(module, may_use):
        return None  # what the task allows (2.2's MemoryTracker): its own insides are not the learner's
    if isinstance(obj, functools.partial):
        return course_code_used(obj.func, may_use, seen)
    if isinstance(obj, (types.MethodType, staticmethod, classmethod)):
        return course_code_used(obj.__func__, may_use, seen)
    if isinstance(obj, property):
        return next(filter(None, (course_code_used(f, may_use, seen) for f in (obj.fget, obj.fset, obj.fdel)
                                  if f is not None)), None)
    if inspect.isclass(obj):
        bases = (_name_of(b, may_use) or (_learners(b, obj) and course_code_used(b, may_use, seen))
                 for b in obj.__mro__[1:])
        members = (course_code_used(m, may_use, seen) for m in vars(obj).values()
                   if callable(m) or isinstance(m, (staticmethod, classmethod, property)))
        return next(filter(None, itertools.chain(bases, members)), None)
    if not isinstance(obj, types.FunctionType):
        return None
    values = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
    values += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
    for code in code_objects(obj.__code__):
        for name in code.co_names:
            module = _course_module(name, may_use)   # `import mgpu_helpers.x` / `from mgpu_helpers.x import y`
            if module:
                return module
            if name in obj.__globals__:
                values.append(obj.__globals__[name])
    # a value that is course code, or a helper of the learner's own (same notebook) to follow
    found = (_name_of(v, may_use) or (_learners(v, obj) and course_code_used(v, may_use, seen)) for v in values)
    return next(filter(None, found), None)


def _learners(value, obj) -> bool:
    """Defined where ``obj`` was (the learner's notebook), not in a library: worth following."""
    if isinstance(value, functools.partial):
        value = value.func
    if not (isinstance(value, types.FunctionType) or inspect.isclass(value)):
        return False
    return getattr(value, "__module__", None) in {getattr(obj, "__module__", None), "__main__"}


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def refusal(exercise: str, function: str, used: str) -> str:
    return (f"Exercise {exercise} ✗ {function}: it uses the course's own implementation ({used}); "
            "the exercise is to write it yourself, so this check scores 0")
