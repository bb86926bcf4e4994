"""Chapter 3: the scheduler (continuous batching, chunked prefill, preemption)."""
