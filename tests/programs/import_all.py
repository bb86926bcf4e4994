"""Import every module named on the command line, in this one fresh interpreter.

Run by tests/test_import_graph.py with every module of pyproject's package
map. Prints one line per module that fails to import (a missing mini_vllm
module, or any other exception; a missing optional third-party package is
not a failure) and exits 1 if there is any.

argv: the module names.
"""
import importlib
import sys


def main(names: list[str]) -> int:
    bad = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "mini_vllm":
                bad.append(f"{name}: {e!r}")
        except Exception as e:  # noqa: BLE001  (any import-time error is the finding)
            bad.append(f"{name}: {e!r}")
    print("\n".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
