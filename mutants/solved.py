"""`python -m mutants.solved [--chapter N]`: every exercise, solved with the reference, is green.

The other half of the mutation runner's argument: a mutant proves the tests
fail on a classic mistake; this proves they pass on a correct exercise, run
exactly as a learner runs them (`--impl=exercise`, through the exercise's
given plumbing). In a temporary copy of the package (as `mutants.core`
builds it), each chapter's `exercise.py` gets the reference's answers bound
in place of its stubs, as a learner who pasted the reference would have
them; then the chapter's exercise command runs there. Exits 1 if a chapter
is not green, or if its run selected no test.

No vLLM counterpart (vLLM has no exercises).
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from mutants.core import build_tree, check_tree, run_pytest, tree_path

# Appended to each exercise.py in the copy: the reference's answers under the stubs' names.
# Module-level functions are rebound (the given code looks them up at call time);
# class attributes bound at class creation are rebound too.
SOLUTIONS = {
    "1": ("01_paged_attention/exercise.py", """
from .slot_mapping import compute_slot_mapping
from .cache_ops import reshape_and_cache
from .attention import gather_kv, paged_attention_varlen, paged_attention_decode
"""),
    "2": ("02_kvcache/exercise.py", """
from .block_hash import hash_block_tokens
from .block_pool import BlockPool as _ReferencePool
from .kv_cache_manager import KVCacheManager as _ReferenceManager
for _name in ("get_new_blocks", "_maybe_evict_cached_block", "touch", "free_blocks"):
    setattr(BlockPool, _name, getattr(_ReferencePool, _name))
for _name in ("get_computed_blocks", "free"):
    setattr(KVCacheManager, _name, getattr(_ReferenceManager, _name))
"""),
    "3": ("03_scheduler/exercise.py", """
import types as _types
from .scheduler import Scheduler as _ReferenceScheduler
from .step import StepState as _ReferenceStepState
def _pasted(fn):  # the reference's method as if its text were here: its names (StepState) resolve in this file
    return _types.FunctionType(fn.__code__, globals(), fn.__name__, fn.__defaults__, fn.__closure__)
for _name in ("schedule_running", "pick_victim", "try_admit"):
    setattr(StepState, _name, _pasted(getattr(_ReferenceStepState, _name)))
for _name in ("schedule", "_update_after_schedule", "_replace_placeholder"):
    setattr(Scheduler, _name, _pasted(getattr(_ReferenceScheduler, _name)))
"""),
    "4": ("04_spec_decode/exercise.py", """
from .rejection_sampler import recover_token, rejection_sample_request
from .ngram_proposer import propose_ngram
NgramProposer._propose = staticmethod(propose_ngram)
"""),
    "5": ("05_mini_vllm/exercise.py", """
from .sample.ops.topk_topp import apply_min_p, apply_top_k_top_p
from .worker.prepare_inputs import compute_positions, compute_query_start_loc, compute_slot_mapping
from .worker.model_runner import ModelRunner as _Reference
for _name in ("_update_states", "_prepare_inputs", "execute_model"):
    setattr(ModelRunner, _name, getattr(_Reference, _name))
from .spec_decode.engine.eagle import EagleProposer as _ReferenceEagle
EagleProposer.propose = _ReferenceEagle.propose
from .models.fused_moe.router import fused_topk
"""),
    "6": ("06_global_prefix_cache/exercise.py", """
from .keys import block_keys
from .serde import pack_block, unpack_block
from .connector import GlobalCacheConnector as _Reference
GlobalCacheConnector.block_keys = staticmethod(block_keys)
GlobalCacheConnector.pack_block = staticmethod(pack_block)
GlobalCacheConnector.unpack_block = staticmethod(unpack_block)
GlobalCacheConnector.get_num_new_matched_tokens = _Reference.get_num_new_matched_tokens
GlobalCacheConnector._fetch = _Reference._fetch
"""),
}
CHAPTERS = tuple(SOLUTIONS)
TIMEOUT_S = 1200.0
_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected)")


def solve(tree: Path, dirs: dict[str, str], chapter: str) -> None:
    rel, code = SOLUTIONS[chapter]
    target = tree / tree_path(rel, dirs)
    target.write_text(target.read_text() + "\n# ---- solved with the reference (mutants/solved.py)" + code)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutants.solved", description=__doc__.splitlines()[0])
    parser.add_argument("--chapter", choices=CHAPTERS, action="append", help="chapter to run (repeatable)")
    args = parser.parse_args(argv)
    bad = 0
    with tempfile.TemporaryDirectory(prefix="mini_vllm_solved_") as tmp:
        tree = Path(tmp)
        dirs = build_tree(tree)
        check_tree(tree)
        for ch in args.chapter or CHAPTERS:
            solve(tree, dirs, ch)
            tests = sorted(str(p.relative_to(tree)) for p in tree.glob(f"tests/test_ch{ch}_*.py"))
            start = time.monotonic()
            code, secs, out = run_pytest(tree, ["--impl=exercise", *tests], TIMEOUT_S)
            counts = {k: int(n) for n, k in _SUMMARY.findall(out.splitlines()[-1] if out else "")}
            ok = code == 0 and counts.get("passed", 0) > 0
            bad += not ok
            tail = out.strip().splitlines()[-1] if out.strip() else "(no output)"
            print(f"chapter {ch}: {'green' if ok else 'NOT GREEN'} in {time.monotonic() - start:.0f} s: {tail}",
                  flush=True)
            if not ok:
                print("\n".join(out.splitlines()[-30:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
