"""Building blocks the models share: paged attention and its backends (`attention`, `paged_kv`), rotary embeddings
(`rotary`), float/int8/AWQ linear layers (`quant_dense`, `awq`), the sampler and prompt scoring. Norms and the
decoder blocks live with their model family (`jaxserve.models`)."""
