"""A `ModelRunner` without a model or a KV cache, shared by the tests that drive
the runner's bookkeeping (`_update_states`, `_prepare_inputs`, the sampling
columns) from a real Chapter 3 scheduler: test_ch5_runner.py and
test_ch5_persistent_sampling.py."""
from __future__ import annotations

from dataclasses import dataclass, field


class NoModel:
    """The runner's constructor binds each attention layer to its KV pair; none here."""

    def attention_layers(self):
        return []


@dataclass
class NoCache:
    """What the runner reads of a CacheEngine when nothing is swapped or run:
    the block count its per-step metadata check uses, and no tensors."""

    num_gpu_blocks: int
    gpu_cache: list = field(default_factory=list)


@dataclass
class VocabConfig:
    vocab_size: int


def bare_runner(runner_cls, vocab: int, num_blocks: int, block_size: int, max_num_seqs: int,
                max_model_len: int = 64):
    """`runner_cls` (the reference ModelRunner or the exercise's) on the fakes above, on the CPU."""
    return runner_cls(NoModel(), VocabConfig(vocab), NoCache(num_blocks), block_size, max_num_seqs,
                      max_model_len, "cpu")
