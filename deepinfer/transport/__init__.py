"""Wire protocols between processes, torch-free: direct KV transfer (kv_transfer.py, shared by
prefill/decode and the image encoder), and KV events (kv_event_log.py: what the prefix caches
gained and lost; kv_events.py: vLLM's wire format on a PUB socket)."""
