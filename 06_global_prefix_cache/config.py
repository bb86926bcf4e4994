"""`kv_transfer_config`: which connector, which role, and its backend options.

vLLM counterpart: `vllm/config/kv_transfer.py` (`KVTransferConfig`: the fields
`kv_connector`, `kv_role`, `kv_connector_extra_config`,
`kv_connector_module_path`, and the properties `is_kv_producer` /
`is_kv_consumer`).

Invariants (checked at construction, each a ValueError naming the field):
* `kv_connector` is a registered connector name; with
  `kv_connector_module_path` (a dotted module path, as in vLLM) the class of
  that name is taken from that module instead (the Chapter 6 exercise plugs
  in its connector this way);
* `kv_role` is one of kv_producer (saves only), kv_consumer (loads only),
  kv_both (saves and loads);
* every key of `kv_connector_extra_config` is known, and numeric options are
  positive.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("GlobalCacheConnector", "PDConnector")
BACKENDS = ("local", "valkey", "mooncake", "p2p")

# extra-config key -> (default, description); numbers must be > 0.
EXTRA_DEFAULTS: dict[str, object] = {
    "backend": "local",            # one of BACKENDS
    "url": None,                   # redis:// URL (backend "valkey") or mooncake master host:port
    "metadata_server": None,       # mooncake only: its metadata server URL
    "p2p_rank": None,              # p2p only: 0 = producer (sends), 1 = consumer (receives)
    "pool_name": "default",        # in-process pools with one name are one pool
    "capacity_bytes": 256 << 20,   # byte budget of the in-process LRU pool
    "timeout_s": 0.5,              # bound on one store call (lookup, load, save)
    "retry_interval_s": 2.0,       # after a store failure, skip it this long before retrying
    "max_pending_save_bytes": 64 << 20,  # saves beyond this queue are dropped (counted)
    "key_prefix": "mvllm",         # namespace of keys in a shared server
    "model_id": None,              # overrides the model's content fingerprint
    "tp_rank": 0,                  # tensor-parallel rank (part of the fingerprint)
}
_POSITIVE = ("capacity_bytes", "timeout_s", "retry_interval_s", "max_pending_save_bytes")


@dataclass
class KVTransferConfig:
    kv_connector: str = "GlobalCacheConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        path = self.kv_connector_module_path
        if path is not None and not (isinstance(path, str) and all(p.isidentifier() for p in path.split("."))):
            raise ValueError(f"kv_connector_module_path must be a dotted module path, got {path!r}")
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown key(s) {unknown}; "
                             f"known: {sorted(EXTRA_DEFAULTS)}")
        merged = {**EXTRA_DEFAULTS, **extra}
        if merged["backend"] not in BACKENDS:
            raise ValueError(f"kv_connector_extra_config['backend'] must be one of {BACKENDS}, "
                             f"got {merged['backend']!r}")
        for k in _POSITIVE:
            v = merged[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"kv_connector_extra_config[{k!r}] must be a number > 0, got {v!r}")
        if not isinstance(merged["tp_rank"], int) or merged["tp_rank"] < 0:
            raise ValueError(f"kv_connector_extra_config['tp_rank'] must be an int >= 0, "
                             f"got {merged['tp_rank']!r}")
        if merged["backend"] == "valkey" and not str(merged["url"] or "").startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError("kv_connector_extra_config['url'] must be a redis://, rediss:// or "
                             f"unix:// URL for backend 'valkey', got {merged['url']!r}")
        if merged["backend"] == "mooncake" and not (merged["url"] and merged["metadata_server"]):
            raise ValueError("kv_connector_extra_config['url'] (master host:port) and "
                             "['metadata_server'] are required for backend 'mooncake'")
        if merged["backend"] == "p2p" and (merged["p2p_rank"] not in (0, 1) or not str(
                merged["url"] or "").startswith("tcp://")):
            raise ValueError("backend 'p2p' needs kv_connector_extra_config['p2p_rank'] in {0, 1} "
                             f"and a tcp:// rendezvous 'url', got {merged['p2p_rank']!r} and "
                             f"{merged['url']!r}")
        self.extra = merged

    @classmethod
    def from_dict(cls, d) -> "KVTransferConfig":
        if isinstance(d, KVTransferConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"kv_transfer_config must be a dict, got {type(d).__name__}")
        known = ["kv_connector", "kv_connector_extra_config", "kv_connector_module_path", "kv_role"]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown key(s) {unknown}; known: {known}")
        return cls(**d)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
