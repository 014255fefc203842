"""File formats read without torch: the GGUF header (the model loader's tensor table starts where it ends)."""
