"""Attention, every variant together: the mixers (GQA/MHA/MQA in `gqa.py`, DeepSeek's latent
attention in `mla.py`, chosen by `model.attention` through `mixers.py`) and the dot-product
kernels they share (`dot_product.py`: dense XLA, cuDNN, splash; `chunked.py`: blockwise, memory
linear in the context), chosen by the execution setting `attention_impl`."""
