"""No exercise runs a reference answer.

A learner's stub must raise until they write it; an exercise that imported or
subclassed the module holding the answer would quietly run the reference
instead (a missing method inherited, a given helper calling the reference's
function). Two rules, checked statically and by identity:
* Chapters 1 to 6: exercise.py imports none of the chapter's answer
  modules (its given parts live in modules that hold no answer);
* Chapter 2: the given classes are not subclasses of the reference's, and
  every lesson method is the exercise's own.
"""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ANSWER_MODULES = {  # chapter package: modules that hold the exercise's answers
    "mini_vllm.paged_attention": {"slot_mapping", "cache_ops", "attention"},
    "mini_vllm.scheduler": {"step", "scheduler"},
    "mini_vllm.kvcache": {"block_hash", "block_pool", "kv_cache_manager"},
    "mini_vllm.spec_decode": {"rejection_sampler", "ngram_proposer"},
    "mini_vllm": {"model_runner", "prepare_inputs", "ops_topk_topp", "engine_api"},
    "mini_vllm.global_cache": {"keys", "serde", "connector", "factory"},
}
GIVEN_COPIES = {  # exercise module: {class: (reference module, lesson methods)}
    "mini_vllm.kvcache.exercise": {
        "BlockPool": ("mini_vllm.kvcache.block_pool",
                      ("get_new_blocks", "_maybe_evict_cached_block", "touch", "free_blocks")),
        "KVCacheManager": ("mini_vllm.kvcache.kv_cache_manager", ("get_computed_blocks", "free")),
    },
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Fully qualified modules that `path` (a module of `package`) imports directly."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y, from . import x
                base = ".".join([package] + ([base] if base else []))
                if not node.module:
                    out.update(f"{base}.{a.name}" for a in node.names)
                    continue
            out.add(base)
    return out


@pytest.mark.parametrize("package", sorted(ANSWER_MODULES))
def test_exercise_imports_no_answer_module(package):
    path = Path(importlib.util.find_spec(f"{package}.exercise").origin)
    got = imported_modules(path, package)
    bad = sorted(m for m in got if m.removeprefix(package + ".") in ANSWER_MODULES[package])
    assert not bad, (f"{package}.exercise imports {bad}, which hold the exercise's answers: a stub could "
                     "run the reference's code; move the given parts to a module without answers")


@pytest.mark.parametrize("module", sorted(GIVEN_COPIES))
def test_given_classes_are_copies_with_the_learners_methods(module):
    ex = importlib.import_module(module)
    for cls_name, (ref_module, lesson) in GIVEN_COPIES[module].items():
        cls, ref = getattr(ex, cls_name), getattr(importlib.import_module(ref_module), cls_name)
        assert not issubclass(cls, ref), f"{module}.{cls_name} subclasses the reference: it inherits its answers"
        for name in lesson:
            fn = cls.__dict__.get(name)
            assert fn is not None and fn.__module__ == module, (
                f"{module}.{cls_name}.{name} is not the exercise's own method: the learner's stub would be "
                "the reference's answer")
