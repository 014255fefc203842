"""`deepinfer serve --role encode`: DeepSeek-V4.1's vision encoder as its own service (issue 21).

It preprocesses and encodes the images that engines started with `--encoder URL` send it, and
leases each image's embeddings on a direct-transfer listener (transport/kv_transfer.py) for the
engine to pull; it loads the vision tower only, never the language model.
"""
