"""Course plumbing shared by every chapter's `exercise.py`: the "given" copy of
a reference class. It lives in the first chapter so that imports keep
flowing one way (every later chapter already depends on this one).
"""
from __future__ import annotations


def given_class(cls: type, *lesson: str) -> type:
    """A copy of the reference class `cls` lacking the methods in `lesson`.

    Not a subclass: nothing of the lesson is inherited, so a method missing
    from the exercise is an AttributeError, never the reference's answer; the
    given parts stay in step with later fixes of the reference.
    """
    ns = dict(vars(cls))
    for name in lesson:
        if name not in ns:
            raise RuntimeError(f"{cls.__name__}.{name} is not in the reference any more; update exercise.py")
        del ns[name]
    for name in ("__dict__", "__weakref__"):
        ns.pop(name, None)
    for name, fn in ns.items():  # a zero-argument super() would still point at the reference class
        if "__class__" in getattr(getattr(fn, "__code__", None), "co_freevars", ()):
            raise RuntimeError(f"{cls.__name__}.{name} uses super(); it cannot be copied")
    return type(cls.__name__, cls.__bases__, ns)
