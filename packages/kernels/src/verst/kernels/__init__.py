"""verst kernels: per-token log-prob and top-k log-prob kernels."""
