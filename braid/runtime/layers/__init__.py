"""Building blocks of the model files: linear layers with shard-aware loading, norms, rotary
embeddings, activations and embeddings, and the choice of fused kernels a decoder layer runs
(`fusion`)."""
