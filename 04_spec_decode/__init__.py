"""Chapter 4: speculative decoding (rejection sampler and draft proposers)."""
