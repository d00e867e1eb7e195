"""Other engines run on the same workloads as jaxserve, for ratios measured on one machine in one run."""
