"""The KV cache connectors: the seam to KV held beyond device memory (connector.py), the store
connector (offload.py), prefill/decode handoff (pd.py), and what one stored chunk holds (chunks.py)."""
