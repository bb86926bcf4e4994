"""Every notebook is stored executed, top to bottom in one kernel, with its outputs: a reader
of the repository (who has not run it) sees the tables and plots the text talks about.
`make notebooks` executes them in place; `make test` executes them again (nbmake), so a
stored notebook whose code no longer runs fails there."""
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(REPO.glob("0*/*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_executed_in_order(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.relative_to(REPO)} is stored with execution counts {counts}: cells without outputs or run out of "
        "order; run `make notebooks NB=" + str(path.relative_to(REPO)) + "` and commit the result")
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.relative_to(REPO)} is stored with an error output: {errors[0].get('ename')}"
