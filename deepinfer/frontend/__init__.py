"""The API process's side of an engine: the client over the IPC boundary (client.py), turning
engine outputs into text and logprobs (output_processor.py, detokenizer.py). Never imports torch."""
