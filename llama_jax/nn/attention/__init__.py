"""Attention, every variant together: the mixers (GQA/MHA/MQA in `gqa.py`, DeepSeek's latent
attention in `mla.py`, chosen by `model.attention` through `mixers.py`), what they share
(`context.py`: the `Mixer` interface and registry, a forward pass's `Context`, the configured
kernel), and the dot-product kernels, chosen by the execution setting `attention_impl`
(`dot_product.py`: dense XLA, cuDNN, splash; `chunked.py`: blockwise, memory linear in the
context), besides the decode step over GQA's per-layer cache (`dot_product.py`)."""
