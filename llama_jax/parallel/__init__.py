"""Where arrays live: device meshes built from a `mesh:` config, the rules tables that map the
model's logical axis names to mesh axes (`sharding.py`, the only module that knows mesh axes),
multi-host start-up (`distributed.py`), and the devices' free memory now (`devices.py`)."""
