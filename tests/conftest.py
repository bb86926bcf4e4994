"""Shared pytest set-up for the whole course.

Environment first: the Hub is offline, and without CUDA the Triton kernels run
in the interpreter. `TRITON_INTERPRET` is read when a kernel is *defined*, so it
must be set before any `mini_vllm.kernels` module is imported.
"""
import importlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine core in the test's own process unless a test asks for its own process
# (`multiprocess_mode=True`, or a server, which runs it the way it is deployed):
# a spawned core re-imports torch, seconds per engine, and most tests look inside
# the core (`llm.llm_engine.engine_core.engine_core.scheduler`).
os.environ.setdefault("MINI_VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

# One intra-op thread: the tests' tensors are small, and on a shared 2-core
# machine more threads than free cores make PyTorch ops 10-100x slower.
torch.set_num_threads(int(os.environ.get("MINI_VLLM_TEST_THREADS", "1")))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from file_costs import load_costs, order_by_cost, recorder_from_env  # noqa: E402

# Hypothesis profiles. `ci` keeps `make test` fast; `thorough` is for a long soak:
#   HYPOTHESIS_PROFILE=thorough make test-fast
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
# `exercise` (loaded by --impl=exercise) and `mutants` (the mutation runner):
# the same examples on every run and no shrinking, so a failure is reproducible
# and reported within seconds, unshrunk.
for _name in ("exercise", "mutants"):
    settings.register_profile(
        _name,
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        print_blob=True,
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

IMPLS = ("reference", "exercise")


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=IMPLS,
        default="reference",
        help="run chapter tests against the reference modules (default) "
        "or against the learner's exercise.py stubs",
    )


def pytest_configure(config):
    recorder = recorder_from_env()
    if recorder is not None:
        config.pluginmanager.register(recorder, "file-costs-recorder")
    # An exercise run must be reproducible: unless a profile was asked for
    # explicitly, use the derandomized one (before any test module is collected).
    if config.getoption("--impl") == "exercise" and "HYPOTHESIS_PROFILE" not in os.environ:
        settings.load_profile("exercise")


def pytest_collection_modifyitems(config, items):
    # An exercise run keeps only the tests that ask for the implementation
    # (the `impl` fixture, directly or through `chapter`): the others test the
    # reference alone and would pass whatever the learner wrote.
    if config.getoption("--impl") == "exercise":
        uses = ["impl" in getattr(item, "fixturenames", ()) for item in items]
        if not all(uses):
            config.hook.pytest_deselected(items=[item for item, u in zip(items, uses) if not u])
            items[:] = [item for item, u in zip(items, uses) if u]
    # Under pytest-xdist (`make test`): the longest files first, so that both workers
    # finish together (tests/file_costs.py).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order_by_cost(items, load_costs())
        return
    # Hand-built example tests first (stable sort): with -x, the first failure
    # is then a small case whose message names the mistake.
    items.sort(key=lambda item: 0 if item.path.name.endswith("_examples.py") else 1)


def pytest_report_header(config):
    return f"mini-vllm implementation under test: {config.getoption('--impl')}"


def load_chapter(chapter: str, impl: str):
    """The module whose API a chapter's tests exercise.

    `reference` -> the chapter package itself (`mini_vllm.<chapter>`), which
    re-exports its public API; `exercise` -> `mini_vllm.<chapter>.exercise`,
    which exposes the same names, some of them as stubs for the learner.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if chapter == "engine":  # Chapter 5 is the root package itself
        name = "mini_vllm.exercise" if impl == "exercise" else "mini_vllm.exercise_reference"
    else:
        name = f"mini_vllm.{chapter}" + (".exercise" if impl == "exercise" else "")
    return importlib.import_module(name)


@pytest.fixture
def socket_dir():
    """A fresh directory for the engine core's ipc:// socket files, short enough for a Unix
    socket path (107 bytes): pytest's tmp_path under pytest-xdist is too deep for one."""
    import shutil
    import tempfile
    from pathlib import Path
    path = Path(tempfile.mkdtemp(prefix="mv-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def impl(request) -> str:
    """'reference' or 'exercise', from --impl."""
    return request.config.getoption("--impl")


@pytest.fixture(scope="session")
def chapter(impl):
    """Factory fixture: `chapter("paged_attention")` gives the module under test."""
    return lambda name: load_chapter(name, impl)
