"""Building blocks of the model files: linear layers with shard-aware loading, norms, rotary
embeddings, activations and embeddings."""
