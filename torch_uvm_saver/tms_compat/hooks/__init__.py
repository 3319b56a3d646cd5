"""Hook modes, as torch_memory_saver names them: "preload" (LD_PRELOAD) and "torch" (MemPools)."""
