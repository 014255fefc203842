"""DeepSeek-V3 / R1 / V3.x: MLA (mla.py), MoE with DeepSeek's routing, MTP (model.py)."""
