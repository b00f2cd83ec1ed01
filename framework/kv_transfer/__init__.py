"""framework.kv_transfer: the KV-connector interface and the host-memory KV tier."""
