"""Checkpoint formats: Hugging Face (safetensors), Meta (consolidated .pth), native (orbax)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and what was expected."""
