"""`python -m mini_vllm ...`: see `mini_vllm.cli`."""
import sys

from mini_vllm.cli import main

sys.exit(main())
