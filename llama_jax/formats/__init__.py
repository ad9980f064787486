"""Checkpoints: reading and writing Hugging Face (`hf.py`), Meta (`meta.py`), native orbax
(`native.py`) and training-run directories (`workdir.py`, `run.py`), with the tensor layouts they
share (`layout.py`); `checkpoint.py` detects the format and loads any of them into a mesh, and
`convert.py` is the conversion CLI."""
