"""Running past one device: the tensor-parallel layout, the sharding vocabulary (each model family's table is in its
spec, `jaxserve.models`), and multi-host coordination."""
