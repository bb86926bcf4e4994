"""One engine process sharing a Valkey server with the test's own engine.

Run by tests/test_ch6_valkey.py: runs greedy requests through an engine whose
KV connector stores blocks in the server, waits until every block is saved,
and prints {"out": the tokens of each prompt, "saved": blocks saved} as JSON
on its last line.

argv: KV_TRANSFER_CONFIG PROMPTS MAX_TOKENS (the first two as JSON).
"""
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # engine_utils lives there (also in a mutant's copy)


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(TESTS))
    from engine_utils import make_llm, run_greedy

    kv_transfer_config, prompts, max_tokens = json.loads(argv[0]), json.loads(argv[1]), int(argv[2])
    llm = make_llm(kv_transfer_config=kv_transfer_config)
    out = run_greedy(llm, prompts, max_tokens)
    core = llm.llm_engine.engine_core.engine_core
    if not core.kv_connector_worker.flush(20):
        sys.exit("the connector did not save every block within 20 s")
    print(json.dumps({"out": out, "saved": core.kv_connector.stats.blocks_saved}))


if __name__ == "__main__":
    main(sys.argv[1:])
