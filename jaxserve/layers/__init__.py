"""Building blocks shared by the models: rotary embeddings, RMSNorm, paged attention backends, the sampler."""
