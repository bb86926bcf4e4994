"""`python -m mini_vllm ...`: see `mini_vllm.entrypoints.cli`."""
import sys

from mini_vllm.entrypoints.cli import main

sys.exit(main())
