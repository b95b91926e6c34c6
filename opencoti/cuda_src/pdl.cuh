// Programmatic dependent launch (PDL, sm_90+; CUDA Programming Guide, "Programmatic Dependent
// Launch and Synchronization"). Every kernel of opencoti/cuda_src starts with GRID_DEP_WAIT()
// (test_cuda_sources; gemv_int.cu's gemvi_ring first fetches its weights, constants, see below;
// the fused rope + KV stores first compute rope's angles and read their norm weights, below;
// the attention kernels read their plan and the old cells' K / V rows, attention.cu early_rows):
// inside a captured decode graph the backend launches its kernels with the programmatic stream
// serialization attribute (cuda_kernels.Kernel), so a kernel's blocks may be scheduled while the
// kernel before it in the stream still runs; griddepcontrol.wait then blocks until every kernel
// it depends on has completed and its memory writes are visible. Nothing that an earlier kernel
// writes is read or written before it, so a kernel sees exactly what a serialized launch would
// show it. A kernel launched without the attribute returns from the wait at once; before sm_90
// the wait and the trigger compile to nothing. Memory that no kernel writes may be read before the
// wait: the fused rope + KV stores compute rope's angles there from the positions, which the host
// stages, and the frequency factors, and read the q / k norms' weights and biases: weights
// (rope.cuh ROPE_ANGLE_PRE, rope_pre).
// OPENCOTI_PDL_EARLY (default 1; cuda_kernels.PDL_EARLY, OPENCOTI_CUDA_PDL_EARLY=0 builds it 0):
// once past its wait a kernel lets the next one launch (griddepcontrol.launch_dependents), so
// the next kernel's blocks are resident while this one works instead of only its launch latency
// overlapping (H200: 0.2-0.25 us of ~1 us per graph node); a kernel whose inputs include
// constants (the one-token GEMV's weights, gemv_int.cu gemvi_ring) fetches them before its own
// wait. The dependent launches only once every block of this kernel has passed the trigger, i.e.
// is resident, so it never takes a slot this kernel still needs; its wait still waits for this
// kernel's completion. GRID_DEP_WAIT_LATE() waits without the trigger (the dependents launch as
// this kernel completes): gemv_int.cu's batched products, whose early trigger measured slower.
#ifndef OPENCOTI_PDL_EARLY
#define OPENCOTI_PDL_EARLY 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GRID_DEP_WAIT_LATE() asm volatile("griddepcontrol.wait;" ::: "memory")
#if OPENCOTI_PDL_EARLY
#define GRID_DEP_WAIT() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define GRID_DEP_WAIT() GRID_DEP_WAIT_LATE()
#endif
#else
#define GRID_DEP_WAIT() do { } while (0)
#define GRID_DEP_WAIT_LATE() do { } while (0)
#endif
