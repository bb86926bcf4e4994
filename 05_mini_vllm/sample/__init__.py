"""Sampling (vLLM: `vllm/v1/sample/`): `sampler.Sampler`, the batch's parameters as
tensors in `metadata.SamplingMetadata`, filters in `ops/topk_topp`, and the
persistent batch's per-request parameter columns in `sampling_columns`."""
