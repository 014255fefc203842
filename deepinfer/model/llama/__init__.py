"""The Llama family: Llama 2/3, SmolLM2, Qwen2 (QKV bias), Qwen3 (QK-norm), Mistral windows;
GGUF decode layers (gguf_decode.py)."""
