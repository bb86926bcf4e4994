"""`pytest -p gpu_check_parts.pytest_plugin`: the test run imports `mini_vllm`
from this checkout, installed or not (see `environment.use_source_tree`)."""
from gpu_check_parts.environment import use_source_tree

use_source_tree()
