"""Chapter 6's store keys, computed in a fresh process.

Run by tests/test_ch6_units.py under another PYTHONHASHSEED than the test's:
keys must be the same in every process, so they cannot use Python's salted
hash(). Prints the keys as one JSON list.

argv: MODULE PREFIX LAYOUT TOKENS SALT
  MODULE  the module whose `block_keys` runs (the reference or the exercise)
  LAYOUT  KVLayout's fields, a JSON list; TOKENS the token ids, a JSON list
"""
import importlib
import json
import sys


def main(argv: list[str]) -> None:
    module, prefix, layout, tokens, salt = argv
    keys_module = importlib.import_module(module)
    from mini_vllm.global_cache import KVLayout

    keys = keys_module.block_keys(prefix, KVLayout(*json.loads(layout)), json.loads(tokens), salt)
    print(json.dumps(keys))


if __name__ == "__main__":
    main(sys.argv[1:])
