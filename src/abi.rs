//! Records that cross the CUDA/Rust line, mirrored from `kernels/include/fep_abi.h`.
//! (bindgen generation lands with the kernel build, issue 3.)
