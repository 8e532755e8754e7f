//! libnccl-net-prism.so: the NCCL net plugin ABI.
