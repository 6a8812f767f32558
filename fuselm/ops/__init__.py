"""Op families: each file holds its Triton kernels, its PyTorch reference and its ``fuselm::`` ops."""
