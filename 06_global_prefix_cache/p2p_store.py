"""A point-to-point "store" for P/D: the prefill engine sends each saved block
straight to the decode engine with `torch.distributed` send/recv (gloo on CPU).

vLLM counterpart: `vllm/distributed/kv_transfer/kv_connector/v1/p2p/`
(`p2p_nccl_connector.py`, `p2p_nccl_engine.py`: the producer sends KV tensors
to the consumer over NCCL; the consumer keeps them in a receive buffer until
its scheduler asks). Here the transport is gloo, so it runs on CPU; on CUDA
the same calls would use an NCCL group.

Two ranks in one group: rank 0 (the producer) sends, rank 1 (the consumer)
runs a receiver thread that files every block into an in-process LRU
mailbox, which its connector reads like any store. Per batch the protocol is:
    [n] ; n x ([key bytes, value bytes] ; key+value as uint8) ; ack [n] back
The producer's put returns only after the ack, so once the prefill engine has
flushed its saves (before it reports a finished request) the decode engine
already holds the prompt. Values keep their checksums: the consumer verifies
them exactly as it verifies values from a server.
Invariant: puts run on the saver thread only, so a dead peer can stall that
thread but never an engine step.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch

from .local_pool import LocalLRUPool
from .store import KVStore

PRODUCER, CONSUMER = 0, 1
logger = logging.getLogger("mini_vllm.global_cache")


class P2PStore(KVStore):
    name = "p2p"

    def __init__(self, url: str, rank: int, capacity_bytes: int, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        if rank not in (PRODUCER, CONSUMER):
            raise ValueError(f"kv_connector_extra_config['p2p_rank'] must be 0 (producer) or 1 "
                             f"(consumer), got {rank!r}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process")
        self.dist, self.rank = dist, rank
        # Both engines block here until the other joins (start them in parallel).
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s))
        self.mailbox = LocalLRUPool(int(capacity_bytes))
        self.num_received = 0
        if rank == CONSUMER:
            self._receiver = threading.Thread(target=self._receive_loop, name="kv-p2p-recv", daemon=True)
            self._receiver.start()

    # ---------------------------------------------------------- producer
    def batch_put(self, items) -> None:
        if self.rank != PRODUCER or not items:
            return  # a consumer publishes nothing
        d = self.dist
        d.send(torch.tensor([len(items)], dtype=torch.int64), CONSUMER)
        for key, value in items:
            kb = key.encode()
            d.send(torch.tensor([len(kb), len(value)], dtype=torch.int64), CONSUMER)
            d.send(torch.frombuffer(bytearray(kb + bytes(value)), dtype=torch.uint8), CONSUMER)
        ack = torch.zeros(1, dtype=torch.int64)
        d.recv(ack, CONSUMER)
        if int(ack) != len(items):
            raise RuntimeError(f"p2p ack {int(ack)} for a batch of {len(items)} blocks")

    # ---------------------------------------------------------- consumer
    def _receive_loop(self) -> None:
        try:
            self._receive_batches()
        except RuntimeError as e:  # the producer closed the connection (it stopped)
            logger.info("p2p receiver stopped: %s", str(e).splitlines()[0][:200])

    def _receive_batches(self) -> None:
        d = self.dist
        while True:
            n = torch.zeros(1, dtype=torch.int64)
            d.recv(n, PRODUCER)
            if int(n) < 0:  # the producer is closing
                return
            got = []
            for _ in range(int(n)):
                head = torch.zeros(2, dtype=torch.int64)
                d.recv(head, PRODUCER)
                klen, vlen = int(head[0]), int(head[1])
                buf = torch.empty(klen + vlen, dtype=torch.uint8)
                d.recv(buf, PRODUCER)
                raw = buf.numpy().tobytes()
                got.append((raw[:klen].decode(), raw[klen:]))
            self.mailbox.batch_put(got)
            self.num_received += len(got)
            d.send(torch.tensor([len(got)], dtype=torch.int64), PRODUCER)

    def close(self) -> None:
        """Producer: tell the consumer's receiver to stop; then both leave the group."""
        if not self.dist.is_initialized():
            return
        try:
            if self.rank == PRODUCER:
                self.dist.send(torch.tensor([-1], dtype=torch.int64), CONSUMER)
            else:
                self._receiver.join(5.0)
            self.dist.destroy_process_group()
        except RuntimeError as e:  # the peer is already gone
            logger.info("p2p close: %s", str(e).splitlines()[0][:200])

    def batch_get(self, keys):
        return self.mailbox.batch_get(keys)

    def batch_exists(self, keys):
        return self.mailbox.batch_exists(keys)
