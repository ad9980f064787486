"""Checkpoints: reading and writing Hugging Face (`hf.py`), Meta (`meta.py`), GGUF (`gguf.py`),
native orbax (`native.py`) and training-run directories (`workdir.py`), with the torch tensor
layout HF, Meta and GGUF share (`torch_layout.py`) and the loading every format shares (`loading.py`: a dtype or a
quantization, onto a mesh); `checkpoint.py` detects the format and loads any of them, and
`convert.py` is the conversion CLI."""
