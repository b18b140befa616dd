"""``python -m optax_sparse_adam``: what a bug report needs (versions, platform, devices, the kernel path and why)."""

from optax_sparse_adam._info import main

if __name__ == "__main__":
    main()
