"""The model assembled from its components: the parameter tree and its layer groups
(`params.py`), the block, the layer scan and the forward pass (`transformer.py`), and the KV cache
that decoding threads through it (`kv_cache.py`)."""
