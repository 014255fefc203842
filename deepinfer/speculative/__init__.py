"""Speculative decoding: proposers (n-gram, draft model, MTP), the lossless verifier, and the
verification-length policy. See docs/speculative_decoding.md; the engine core builds it with
`deepinfer.speculative.build.build_speculative_decoder` when `speculative_method` is set."""
