"""Running past one device: the tensor-parallel layout, the sharding table, and multi-host coordination."""
