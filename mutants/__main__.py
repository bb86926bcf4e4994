"""`python -m mutants [--chapter 1|2|3|4|5|6] [--only NAME] [--no-baseline]`

Runs each chapter's mutants against its tests and prints one row per mutant:
chapter, mutant, caught or not, seconds, first failure message. Exits 1 if any
mutant survives, times out (60 s) or is bad; 2 if a catalogue does not apply.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from mutants.core import HEADER, MutantError, format_row, run_catalogue

CHAPTERS = ("1", "2", "3", "4", "5", "6")


def load(chapters) -> dict:
    catalogue = {}
    for ch in chapters:
        try:
            module = importlib.import_module(f"mutants.ch{ch}")
        except ModuleNotFoundError as e:
            if e.name != f"mutants.ch{ch}":
                raise
            print(f"chapter {ch}: no catalogue (mutants/ch{ch}.py) yet, skipped")
            continue
        catalogue[ch] = list(module.MUTANTS)
    return catalogue


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutants", description=__doc__.splitlines()[2])
    parser.add_argument("--chapter", choices=CHAPTERS, action="append",
                        help="chapter to run (repeatable; default: all)")
    parser.add_argument("--only", metavar="NAME", help="run only the mutant with this name")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip checking that the unmutated tests pass first")
    args = parser.parse_args(argv)
    catalogue = load(args.chapter or CHAPTERS)
    names = [m.name for ms in catalogue.values() for m in ms]
    if args.only and args.only not in names:
        parser.error(f"--only {args.only!r} names no mutant; known: {', '.join(names)}")
    start = time.monotonic()
    print(HEADER, flush=True)
    try:
        results = run_catalogue(catalogue, args.only, baseline=not args.no_baseline,
                                report=lambda line: print(line, flush=True))
    except MutantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(bad)}/{len(results)} mutants caught in {time.monotonic() - start:.0f} s")
    for r in bad:
        print(f"NOT CAUGHT: {format_row(r)}\n    why it matters: {r.mutant.why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
