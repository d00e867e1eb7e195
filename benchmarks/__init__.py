"""jaxserve benchmarks: offline throughput, online serving, kernels, HF baseline and roofline (see RESULTS.md)."""
