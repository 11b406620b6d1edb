"""The GPU runtime, apart from the DCP rules: the device through NVIDIA's cuda-core (`cuda`), the Triton kernels'
cubin cache (`cubin`), the scan's pinned staging (`staging`) and the GPU scan itself (`scan_cuda`)."""
