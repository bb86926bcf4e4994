"""Mutation catalogues: classic mistakes planted in the reference, each of which
the chapter's tests must catch. Run them with `python -m mutants` (`make mutants`).

Each `mutants/chN.py` defines `MUTANTS: list[Mutant]`; `mutants/core.py` holds
the `Mutant` dataclass and the runner.
"""
from mutants.core import Mutant, Result, run_catalogue  # noqa: F401
