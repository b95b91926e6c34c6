// Programmatic dependent launch (PDL, sm_90+; CUDA Programming Guide, "Programmatic Dependent
// Launch and Synchronization"). Every kernel of opencoti/cuda_src starts with GRID_DEP_WAIT():
// inside a captured decode graph the backend launches its kernels with the programmatic stream
// serialization attribute (cuda_kernels.Kernel), so a kernel's blocks may be scheduled while the
// kernel before it in the stream still runs; griddepcontrol.wait then blocks until every kernel
// it depends on has completed and its memory writes are visible. Nothing is read or written
// before it, so a kernel sees exactly what a serialized launch would show it; only the launch
// latency between kernels overlaps (H200: 0.2-0.25 us of ~1 us per graph node). A kernel launched
// without the attribute returns from the wait at once; before sm_90 it compiles to nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GRID_DEP_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define GRID_DEP_WAIT() do { } while (0)
#endif
